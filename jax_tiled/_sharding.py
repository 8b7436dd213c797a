"""Partitioning of `tiled_matmul`: each device runs the kernel on its local blocks.

A bare custom call is opaque to XLA's partitioner, which then gathers every
sharded operand onto every device (jax-ml/jax#32098). So the lowering
(`_lowering.py`) wraps its FFI call in `partitioned(call)`, a
`custom_partitioning` function:

- the Shardy rule names the factors of the canonical product, `b m k, b k n ->
  b m n` permuted by the transpose flags, with K a reduction factor and a
  broadcast (size-1) batch its own factor, so that propagation treats the call
  as it treats `dot_general`;
- `partition` turns the shardings it is offered into one assignment of mesh axes
  to the factors batch, M, N, K, and returns the per-device program: `call`
  on local blocks; where K is split, a sum over those mesh axes (a
  reduce-scatter where the result is wanted sharded on them; the padded tail
  of a K its axes do not divide is zeroed first); and where an operand's M or
  N is split on axes the result gives to the other free dimension, a gather of
  that operand. With `jax_tiled.overlap` enabled (the default) the sum and
  the gather are rings of `ppermute`s interleaved with the products
  (`_rings.py`), otherwise one collective each (the gather then left to the
  partitioner);
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
import functools
import math

import jax
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxlib.mlir import ir

from jax_tiled import _canonical, _compat, _ffi, _rings, overlap
from jax_tiled._canonical import positions

FACTORS = ("batch", "m", "n", "k")


def _sizes(transpose_a, transpose_b, a_shape, b_shape) -> dict[str, int]:
    batch, m, n, k = _canonical.problem_dims(a_shape, b_shape, transpose_a, transpose_b)
    return dict(batch=batch, m=m, n=n, k=k)


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
    (ab, am, ak), (bb, bk, bn) = positions(transpose_a, transpose_b)
    a, b = _spec(a_sharding), _spec(b_sharding)
    batch = _canonical.batch(a_shape[0], b_shape[0])
    return {
        "batch": [a[ab]] * (a_shape[0] == batch) + [b[bb]] * (b_shape[0] == batch),
        "m": [a[am]],
        "n": [b[bn]],
        "k": [a[ak], b[bk]],
    }


def _operand_specs(transpose_a, transpose_b, a_shape, b_shape, assignment):
    """PartitionSpecs of a and b that split each factor on its assigned axes."""
    batch = _canonical.batch(a_shape[0], b_shape[0])

    def place(dims, shape, factors):
        spec = [None] * 3
        for d, factor in zip(dims, factors):
            spec[d] = _entry(assignment[factor]) if factor != "batch" or shape[0] == batch else None
        return P(*spec)

    a_dims, b_dims = positions(transpose_a, transpose_b)
    return place(a_dims, a_shape, ("batch", "m", "k")), place(b_dims, b_shape, ("batch", "k", "n"))


# ---- Trace time: manual-axis and sharding types ----


def match_varying(a, b):
    """a and b cast to vary over the same manual axes, as jax's own binary ops are.
    A replicated weight left invariant would make the product's transpose skip
    the sum of the weight's cotangent over the axes the other operand varies on."""
    both = _compat.varying_axes(jax.typeof(a)) | _compat.varying_axes(jax.typeof(b))

    def cast(x):
        missing = tuple(sorted(both - _compat.varying_axes(jax.typeof(x))))
        return _compat.cast_to_varying(x, missing) if missing else x

    return cast(a), cast(b)


def result_aval(a, b, shape, dtype, transpose_a: bool, transpose_b: bool):
    """The result's abstract value: the operands' manual-axis type and, under
    explicit mesh axes, the sharding of `dot_general`'s rule with K summed."""
    a_varying, b_varying = _compat.varying_axes(a), _compat.varying_axes(b)
    if a_varying != b_varying:
        raise TypeError(
            f"tiled_matmul: operands vary over different manual mesh axes, "
            f"{sorted(a_varying)} and {sorted(b_varying)}; cast one with "
            "jax.lax.pcast(x, axes, to='varying') (jax_tiled.matmul does this itself)"
        )
    a_mesh, b_mesh = a.sharding.mesh, b.sharding.mesh
    if not a_mesh.empty and not b_mesh.empty and a_mesh != b_mesh:
        raise TypeError(f"tiled_matmul: operands are on different meshes, {a_mesh} and {b_mesh}")
    fix = (
        "reshard an operand with jax.sharding.reshard so that they agree, or use "
        "AxisType.Auto mesh axes"
    )
    chosen = {}
    for factor, candidates in _operand_axes(
        transpose_a, transpose_b, a.shape, a.sharding, b.shape, b.sharding
    ).items():
        split = set(filter(None, candidates))
        if len(split) > 1:
            raise TypeError(
                f"tiled_matmul: a and b split the {factor} dimension differently, "
                f"over mesh axes {sorted(split)}; {fix}"
            )
        chosen[factor] = split.pop() if split else ()
    out = [chosen[f] for f in ("batch", "m", "n")]
    flat = [axis for axes in out for axis in axes]
    if len(flat) != len(set(flat)):
        raise TypeError(
            f"tiled_matmul: the result (batch, M, N) would be split over one mesh "
            f"axis twice: {out}; {fix}"
        )
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
            "that only its first batch dimension is split, or use AxisType.Auto mesh axes"
        )
    return bool(spec) and bool(spec[0])


# ---- Partitioning ----


def _assign(product, mesh, a, b, result_sharding=None) -> dict[str, tuple]:
    """factor -> mesh axes, from the operands' shardings and the result's, if known.

    First batch, M and N take the axes that both the result asks for and their
    operand already has; then K keeps the axes an operand splits it on (the
    other operand is sliced, not gathered); then batch, M and N take what the
    result asks for, else what their operand has. An axis serves one factor.
    The partitioner reshards operands to match.
    """
    candidates = _operand_axes(
        product.transpose_a, product.transpose_b, a.shape, a.sharding, b.shape, b.sharding
    )
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


def _gathered_free_dim(candidates, assignment):
    """("a", axes) or ("b", axes) where the operand splits its M (a) or N (b) on
    mesh axes that the assignment gives to the other operand's free dimension:
    the all-gather pattern (sequence-sharded activations times a column-sharded
    weight), which a ring gathers while it multiplies. None where K is split
    (the sum would need a second ring) or the axes serve the batch."""
    if assignment["k"]:
        return None
    for gathered, own, other in (("a", "m", "n"), ("b", "n", "m")):
        axes = candidates[own][0]
        if axes and not assignment[own] and set(axes) <= set(assignment[other]):
            return gathered, axes
    return None


def _partition(call, product, settings, mesh, arg_shapes, result_shape):
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
    scatter = next(
        (
            d
            for d, f in enumerate(("batch", "m", "n"))
            if k_axes and not out_axes[d] and wanted[d] == k_axes and sizes[f] % k_split == 0
        ),
        None,
    )
    if scatter is not None:
        out_axes[scatter] = k_axes
    dims = positions(*flags)
    (_, _, ak), (_, bk, _) = dims
    operand_assignment = dict(assignment)
    gather = None
    if settings.enabled:
        gather = _gathered_free_dim(
            _operand_axes(*flags, a.shape, a.sharding, b.shape, b.sharding), assignment
        )
        if gather is not None:
            # The operand keeps its split; the ring, not the partitioner, gathers it.
            operand_assignment["m" if gather[0] == "a" else "n"] = gather[1]
    ring_k = settings.enabled and k_split > 1
    gpu = product.target == _ffi.TARGETS["cuda"]
    copy_engines = gpu and overlap.permutes_by_copy_engines()
    if ring_k:
        # The ring's blocks follow the result dimension to scatter into, or where
        # the result is replicated over K's axes, the longer of M and N (M, N of
        # this device's blocks: other axes may split them).
        local = lambda f: -(-sizes[f] // math.prod(mesh.shape[x] for x in assignment[f]))
        longer = "m" if local("m") >= local("n") else "n"
        chunked = ("batch", "m", "n")[scatter] if scatter is not None else longer
        # k_ring="collectives" cuts the result across the scattered dimension.
        across = {"m": "n", "n": "m"}.get(chunked, longer) if scatter is not None else longer
        k_ring = settings.ring(
            k_split, replicated=scatter is None, gpu=gpu, copy_engines=copy_engines
        )
        pieces = settings.pieces(k_ring)

    # A ring's products that run beside a transfer leave SMs to it (none where
    # the transfers run on the copy engines).
    beside_transfer = dataclasses.replace(
        product, spare_sms=settings.spares(k_ring, copy_engines) if ring_k else 0
    )
    beside_gather = dataclasses.replace(product, spare_sms=settings.gather_spares(copy_engines))

    def lower_fn(a, b):
        # Per-device code has no mesh: under the caller's explicit one, jax 0.8
        # gives the all-reduce a sharded reduction body that XLA rejects.
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return local_product(a, b)

    def local_product(a, b):
        if gather is not None:
            gathered, axes = gather
            common = dict(
                axes=axes,
                n=math.prod(mesh.shape[x] for x in axes),
                gathered=gathered,
                dims=dims,
                size=sizes["m" if gathered == "a" else "n"],
                beside_transfer=beside_gather,
                barrier=settings.gather_barrier,
            )
            if settings.gather_ring == "collectives":
                return _rings.all_gather_pieces(
                    call, product, a, b, pieces=settings.gather_pieces(), **common
                )
            return _rings.all_gather_ring(call, product, a, b, **common)
        if not k_axes:
            return call(a, b, product, product.out_dtype)
        if sizes["k"] % k_split:
            # The last blocks of an uneven K are padded with arbitrary values.
            a = _zero_k_padding(a, ak, k_axes, sizes["k"])
            b = _zero_k_padding(b, bk, k_axes, sizes["k"])
        # Partial products are computed in the accumulation type; the sums
        # ring sends its running sums in the result's (settings.k_sums: half
        # the bytes of a 16-bit result's float32), the all-reduce below adds
        # them unrounded, so that a 16-bit result is rounded once.
        acc = _canonical.accumulation_dtype(product.out_dtype)
        if ring_k:
            ring = dict(
                axes=k_axes,
                n=k_split,
                factor=chunked,
                dims=dims,
                gather=scatter is None,
                acc_dtype=acc,
                beside_transfer=beside_transfer,
            )
            if k_ring == "operands":
                return _rings.operand_ring(call, product, a, b, **ring)
            sums = product.out_dtype if settings.k_sums == "output" else acc
            if k_ring == "collectives":
                return _rings.collective_pieces(
                    call, product, a, b, axes=k_axes, dims=dims, scatter=scatter,
                    across=across, pieces=pieces, sum_dtype=sums,
                    beside_transfer=beside_transfer,
                )  # fmt: skip
            return _rings.reduce_scatter_ring(
                call, product, a, b, pieces=pieces, send_dtype=sums, **ring
            )
        partial = call(a, b, product, acc)
        if scatter is None:
            total = lax.psum(partial, k_axes)
        else:
            total = lax.psum_scatter(partial, k_axes, scatter_dimension=scatter, tiled=True)
        return total.astype(product.out_dtype)

    a_spec, b_spec = _operand_specs(*flags, a.shape, b.shape, operand_assignment)
    named = lambda spec: NamedSharding(mesh, spec)
    return mesh, lower_fn, named(P(*map(_entry, out_axes))), (named(a_spec), named(b_spec))


def _infer_sharding_from_operands(product, settings, mesh, arg_shapes, result_shape):
    assignment = _assign(product, mesh, *arg_shapes)
    return NamedSharding(mesh, P(*(_entry(assignment[f]) for f in ("batch", "m", "n"))))


def _sharding_rule(product, settings, mesh, operand_types, result_types):
    """`batch m k, batch k n -> batch m n` in stored order. A broadcast batch is
    a factor of its own: its size-1 dimension cannot follow the result's."""
    a_batch, b_batch, batch = (
        ir.RankedTensorType(t).shape[0] for t in (*operand_types, *result_types)
    )
    a_dims, b_dims = positions(product.transpose_a, product.transpose_b)

    def mapping(dims, own_batch, batch_factor, factors):
        names = dict(zip(dims, ("batch" if own_batch == batch else batch_factor, *factors)))
        return ArrayMapping(*(names[d] for d in range(3)))

    return SdyShardingRule(
        operand_mappings=(
            mapping(a_dims, a_batch, "abatch", ("m", "k")),
            mapping(b_dims, b_batch, "bbatch", ("k", "n")),
        ),
        result_mappings=(ArrayMapping("batch", "m", "n"),),
        reduction_factors=("k",),
    )


def partitioned(call):
    """`call(a, b, product, out_dtype)`, the FFI call on one device's operands,
    behind the partitioning rule: a function (a, b, product) -> the result,
    for `jax.interpreters.mlir.lower_fun` to lower.

    `product` is static and hashable; the rule reads its `transpose_a`,
    `transpose_b` and `out_dtype`, and hands it on to `call`. The overlap
    settings in force at lowering join it as a static argument, so that the
    partitioning callbacks, which XLA may run later, see the same ones."""

    def unpartitioned(a, b, product, settings):
        return call(a, b, product, product.out_dtype)

    wrapped = custom_partitioning(unpartitioned, static_argnums=(2, 3))
    wrapped.def_partition(
        partition=functools.partial(_partition, call),
        infer_sharding_from_operands=_infer_sharding_from_operands,
        sharding_rule=_sharding_rule,
    )
    return lambda a, b, product: wrapped(a, b, product, overlap.current())
