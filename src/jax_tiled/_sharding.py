"""Partitioning of `tiled_matmul`: each device runs the kernel on its local blocks.

A bare custom call is opaque to XLA's partitioner, which then gathers every
sharded operand onto every device (jax-ml/jax#32098). So the primitive lowers
through `custom_partitioning`:

- the Shardy rule names the factors of the canonical product, `b m k, b k n ->
  b m n` permuted by the transpose flags, with K a reduction factor and a
  broadcast (size-1) batch its own factor, so that propagation treats the call
  as it treats `dot_general`;
- `partition` turns the shardings it is offered into one assignment of mesh axes
  to the factors batch, M, N, K, and returns the per-device program: the FFI
  call on local blocks, then, where K is split, a sum over those mesh axes
  (a reduce-scatter where the result is wanted sharded on them; the padded
  tail of a K its axes do not divide is zeroed first);
- `infer_sharding_from_operands` answers the GSPMD partitioner
  (`jax_use_shardy_partitioner=False`) from the same assignment.

With one device, or inside a fully manual `shard_map`, `custom_partitioning`
lowers straight to the FFI call, so such programs see the plain custom call.
Inside a `shard_map` manual over only some axes, jax offers the callbacks no
mesh, so operands split over the remaining axes are gathered there (correct,
not local).

At trace time, under `AxisType.Explicit` axes the result's sharding is part of
its type and follows `dot_general`'s rule, except that K sharded on both
operands is allowed and summed (the result is replicated over those axes),
which is what the product's transposes need. Inside `shard_map` the operands
are cast to vary over the same manual axes before binding, so that the
transpose of a product with a replicated weight sums its cotangent, as
`jnp.matmul`'s does.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax import lax
from jax._src import dispatch
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

FACTORS = ("batch", "m", "n", "k")


def _dims(transpose_a: bool, transpose_b: bool):
    """Positions of (batch, M, K) in stored a and of (batch, K, N) in stored b."""
    return (0, 2, 1) if transpose_a else (0, 1, 2), (0, 2, 1) if transpose_b else (0, 1, 2)


def _batch(a_shape, b_shape) -> int:
    return a_shape[0] if b_shape[0] == 1 else b_shape[0]


def _sizes(transpose_a, transpose_b, a_shape, b_shape) -> dict[str, int]:
    (_, am, ak), (_, _, bn) = _dims(transpose_a, transpose_b)
    return dict(batch=_batch(a_shape, b_shape), m=a_shape[am], n=b_shape[bn], k=a_shape[ak])


def _axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axis names."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _spec(sharding, ndim: int = 3) -> list[tuple[str, ...]]:
    """Mesh axes per dimension. A sharding without a spec (a GSPMDSharding, which
    partitioning offers where it knows no mesh) reads as replicated."""
    spec = tuple(getattr(sharding, "spec", None) or ())
    return [_axes(e) for e in spec + (None,) * (ndim - len(spec))]


def _operand_axes(transpose_a, transpose_b, a_shape, a_sharding, b_shape, b_sharding):
    """factor -> the mesh axes each operand splits it on (a broadcast batch splits nothing)."""
    (ab, am, ak), (bb, bk, bn) = _dims(transpose_a, transpose_b)
    a, b = _spec(a_sharding), _spec(b_sharding)
    batch = _batch(a_shape, b_shape)
    return {"batch": [a[ab]] * (a_shape[0] == batch) + [b[bb]] * (b_shape[0] == batch),
            "m": [a[am]], "n": [b[bn]], "k": [a[ak], b[bk]]}


def _operand_specs(transpose_a, transpose_b, a_shape, b_shape, assignment):
    """PartitionSpecs of a and b that split each factor on its assigned axes."""
    batch = _batch(a_shape, b_shape)
    def place(dims, shape, factors):
        spec = [None] * 3
        for d, factor in zip(dims, factors):
            spec[d] = _entry(assignment[factor]) if factor != "batch" or shape[0] == batch else None
        return P(*spec)
    a_dims, b_dims = _dims(transpose_a, transpose_b)
    return place(a_dims, a_shape, ("batch", "m", "k")), place(b_dims, b_shape, ("batch", "k", "n"))


# ---- Trace time: manual-axis and sharding types ----

def _varying(aval) -> frozenset:
    """Manual mesh axes a value varies over inside `shard_map` (`aval.vma` before jax 0.10)."""
    mat = getattr(aval, "mat", None)
    return mat.varying if mat is not None else getattr(aval, "vma", frozenset())


def match_varying(a, b):
    """a and b cast to vary over the same manual axes, as jax's own binary ops are.
    A replicated weight left invariant would make the product's transpose skip
    the sum of the weight's cotangent over the axes the other operand varies on."""
    both = _varying(jax.typeof(a)) | _varying(jax.typeof(b))
    def cast(x):
        missing = tuple(sorted(both - _varying(jax.typeof(x))))
        if not missing:
            return x
        if hasattr(lax, "pcast"):
            return lax.pcast(x, missing, to="varying")
        return lax.pvary(x, missing)  # jax < 0.8.2
    return cast(a), cast(b)


def result_aval(a, b, shape, dtype, transpose_a: bool, transpose_b: bool):
    """The result's abstract value: the operands' manual-axis type and, under
    explicit mesh axes, the sharding of `dot_general`'s rule with K summed."""
    if _varying(a) != _varying(b):
        raise TypeError(
            f"tiled_matmul: operands vary over different manual mesh axes, "
            f"{sorted(_varying(a))} and {sorted(_varying(b))}; cast one with "
            "jax.lax.pcast(x, axes, to='varying') (jax_tiled.matmul does this itself)")
    a_mesh, b_mesh = a.sharding.mesh, b.sharding.mesh
    if not a_mesh.empty and not b_mesh.empty and a_mesh != b_mesh:
        raise TypeError(f"tiled_matmul: operands are on different meshes, {a_mesh} and {b_mesh}")
    fix = ("reshard an operand with jax.sharding.reshard so that they agree, or use "
           "AxisType.Auto mesh axes")
    chosen = {}
    for factor, candidates in _operand_axes(transpose_a, transpose_b, a.shape, a.sharding,
                                            b.shape, b.sharding).items():
        split = set(filter(None, candidates))
        if len(split) > 1:
            raise TypeError(f"tiled_matmul: a and b split the {factor} dimension differently, "
                            f"over mesh axes {sorted(split)}; {fix}")
        chosen[factor] = split.pop() if split else ()
    out = [chosen[f] for f in ("batch", "m", "n")]
    flat = [axis for axes in out for axis in axes]
    if len(flat) != len(set(flat)):
        raise TypeError(f"tiled_matmul: the result (batch, M, N) would be split over one mesh "
                        f"axis twice: {out}; {fix}")
    sharding = NamedSharding(b_mesh if a_mesh.empty else a_mesh, P(*map(_entry, out)))
    return a.update(shape=shape, dtype=dtype, weak_type=False, sharding=sharding)


def reshard_like(x, aval):
    """x with aval's sharding type where explicit mesh axes make them differ: a
    cotangent must have its primal's type (dot_general's transposes ensure the
    same with out_sharding), such as a replicated weight's from a K-split product."""
    if _spec(jax.typeof(x).sharding, x.ndim) == _spec(aval.sharding, aval.ndim):
        return x
    return jax.sharding.reshard(x, aval.sharding)


def splits_batch(x, batch_ndim: int = 1) -> bool:
    """Whether explicit mesh axes split x's leading `batch_ndim` dimensions. jax
    can merge them into one only if no dimension after the first is split."""
    spec = _spec(jax.typeof(x).sharding, x.ndim)[:batch_ndim]
    if any(spec[1:]):
        raise ValueError(
            f"jax_tiled.matmul: explicit mesh axes split a batch dimension other than the first: "
            f"{jax.typeof(x).str_short()}; reshard the operand with jax.sharding.reshard so "
            "that only its first batch dimension is split, or use AxisType.Auto mesh axes")
    return bool(spec) and bool(spec[0])


# ---- Partitioning ----

@dataclasses.dataclass(frozen=True)
class Product:
    """Static description of one lowered product, all that `partition` needs."""
    target: str
    transpose_a: bool
    transpose_b: bool
    out_dtype: np.dtype
    precision: int  # the FFI attribute's code
    kernel: str


def _ffi_product(a, b, product: Product, out_dtype):
    (_, am, _), (_, _, bn) = _dims(product.transpose_a, product.transpose_b)
    shape = (_batch(a.shape, b.shape), a.shape[am], b.shape[bn])
    call = jax.ffi.ffi_call(product.target, jax.ShapeDtypeStruct(shape, out_dtype))
    return call(a, b, transpose_a=np.bool_(product.transpose_a),
                transpose_b=np.bool_(product.transpose_b),
                precision=np.int32(product.precision), kernel=product.kernel)


def _assign(product: Product, mesh, a, b, result_sharding=None) -> dict[str, tuple]:
    """factor -> mesh axes, from the operands' shardings and the result's, if known.

    First batch, M and N take the axes that both the result asks for and their
    operand already has; then K keeps the axes an operand splits it on (the
    other operand is sliced, not gathered); then batch, M and N take what the
    result asks for, else what their operand has. An axis serves one factor.
    The partitioner reshards operands to match.
    """
    candidates = _operand_axes(product.transpose_a, product.transpose_b,
                               a.shape, a.sharding, b.shape, b.sharding)
    wanted = dict(zip(("batch", "m", "n"), _spec(result_sharding)))
    assignment = dict.fromkeys(FACTORS, ())
    used: set[str] = set()

    def take(factor, axes):
        if not assignment[factor] and axes and not used & set(axes):
            assignment[factor] = axes
            used.update(axes)

    for factor in ("batch", "m", "n"):
        if wanted[factor] in candidates[factor]:
            take(factor, wanted[factor])
    for axes in candidates["k"]:
        take("k", axes)
    for factor in ("batch", "m", "n"):
        for axes in (wanted[factor], *candidates[factor]):
            take(factor, axes)
    return assignment


def _zero_k_padding(x, dim, k_axes, k_size):
    block = x.shape[dim]
    k = lax.broadcasted_iota(np.int32, x.shape, dim) + lax.axis_index(k_axes) * block
    return lax.select(k < k_size, x, lax.full_like(x, 0))


def _partition(product: Product, mesh, arg_shapes, result_shape):
    a, b = arg_shapes
    flags = product.transpose_a, product.transpose_b
    assignment = _assign(product, mesh, a, b, result_shape.sharding)
    sizes = _sizes(*flags, a.shape, b.shape)
    k_axes = assignment["k"]
    k_split = math.prod(mesh.shape[x] for x in k_axes)
    out_axes = [assignment[f] for f in ("batch", "m", "n")]
    # Where the result is wanted split over K's axes on a dimension the product
    # leaves whole, reduce-scatter into that dimension instead of all-reducing.
    wanted = _spec(result_shape.sharding)
    scatter = next((d for d, f in enumerate(("batch", "m", "n")) if k_axes and not out_axes[d]
                    and wanted[d] == k_axes and sizes[f] % k_split == 0), None)
    if scatter is not None:
        out_axes[scatter] = k_axes
    (_, _, ak), (_, bk, _) = _dims(*flags)

    def lower_fn(a, b):
        # Per-device code has no mesh: under the caller's explicit one, jax 0.8
        # gives the all-reduce a sharded reduction body that XLA rejects.
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return local_product(a, b)

    def local_product(a, b):
        if not k_axes:
            return _ffi_product(a, b, product, product.out_dtype)
        if sizes["k"] % k_split:
            # The last blocks of an uneven K are padded with arbitrary values.
            a = _zero_k_padding(a, ak, k_axes, sizes["k"])
            b = _zero_k_padding(b, bk, k_axes, sizes["k"])
        # Partial sums stay in the accumulation type until summed, so that a
        # 16-bit result is rounded once, as on one device.
        acc = np.float64 if product.out_dtype == np.float64 else np.float32
        partial = _ffi_product(a, b, product, np.dtype(acc))
        if scatter is None:
            total = lax.psum(partial, k_axes)
        else:
            total = lax.psum_scatter(partial, k_axes, scatter_dimension=scatter, tiled=True)
        return total.astype(product.out_dtype)

    a_spec, b_spec = _operand_specs(*flags, a.shape, b.shape, assignment)
    named = lambda spec: NamedSharding(mesh, spec)
    return mesh, lower_fn, named(P(*map(_entry, out_axes))), (named(a_spec), named(b_spec))


def _infer_sharding_from_operands(product: Product, mesh, arg_shapes, result_shape):
    assignment = _assign(product, mesh, *arg_shapes)
    return NamedSharding(mesh, P(*(_entry(assignment[f]) for f in ("batch", "m", "n"))))


def _sharding_rule(product: Product, mesh, operand_types, result_types):
    """`batch m k, batch k n -> batch m n` in stored order. A broadcast batch is
    a factor of its own: its size-1 dimension cannot follow the result's."""
    a_batch, b_batch, batch = (ir.RankedTensorType(t).shape[0]
                               for t in (*operand_types, *result_types))
    a_dims, b_dims = _dims(product.transpose_a, product.transpose_b)
    def mapping(dims, own_batch, batch_factor, factors):
        names = dict(zip(dims, ("batch" if own_batch == batch else batch_factor, *factors)))
        return ArrayMapping(*(names[d] for d in range(3)))
    return SdyShardingRule(
        operand_mappings=(mapping(a_dims, a_batch, "abatch", ("m", "k")),
                          mapping(b_dims, b_batch, "bbatch", ("k", "n"))),
        result_mappings=(ArrayMapping("batch", "m", "n"),),
        reduction_factors=("k",))


def _unpartitioned(a, b, product: Product):
    return _ffi_product(a, b, product, product.out_dtype)


_partitioned = custom_partitioning(_unpartitioned, static_argnums=(2,))
_partitioned.def_partition(partition=_partition,
                           infer_sharding_from_operands=_infer_sharding_from_operands,
                           sharding_rule=_sharding_rule)


def lowering(ctx, a, b, **product):
    """`tiled_matmul`'s lowering rule: the FFI call `target` behind the partitioning rule."""
    out_aval, = ctx.avals_out
    product = Product(out_dtype=np.dtype(out_aval.dtype), **product)
    def partitioned(a, b):
        with jax.named_scope("tiled_matmul"):  # what profiles and HLO dumps name the call
            return _partitioned(a, b, product)
    out, = mlir.lower_fun(partitioned, multiple_results=False)(ctx, a, b)
    # Under explicit axes, keep the sharding that abstract evaluation promised.
    return [mlir.lower_with_sharding_in_types(ctx, out, out_aval)]


def register(primitive) -> None:
    # custom_partitioning's lowering needs the device assignment, which jit only
    # hands to lowering rules of primitives that declare they need it.
    dispatch.prim_requires_devices_during_lowering.add(primitive)
