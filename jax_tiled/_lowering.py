"""The lowering of `tiled_matmul`: one FFI call per platform, behind the partitioning rule.

For each platform whose extension module loaded (`cpu` always, `cuda` where the
package was built with nvcc), the lowering rule

0. reads an operand that is a transpose of its last two axes (`a @ b.T`) as
   stored, through the kernel's transpose flag, instead of copying it first
   (`_stored_form`, where `reads_as_stored`); and the other way round,
   copies b K-major first where `auto`'s kernel reads the layout as stored
   slowly (`copies_b_k_major`); and pads operands whose rows are not whole
   16-byte lines with zeros where that moves `auto` onto a plan that loads
   whole lines (`padding_to_whole_lines`), slicing the result back;
1. checks that the kernel asked for exists on this platform and takes the
   problem (raising the same errors as the API, now that the platform is known);
2. resolves a `lax.DotAlgorithmPreset` for the platform (`_presets`): casts
   of the operands and the result around a product at one of the kernels'
   precision modes, or, for an emulation preset, the product of the
   operands' parts laid along K (`_lower_split`);
3. describes the call as a static `Product` (FFI target, transpose flags,
   output dtype, precision code, kernel name);
4. lowers `ffi_product` behind `_sharding.partitioned`, so that under `jit`
   with sharded operands each device runs the kernel on its own blocks, and on
   one device the program holds just the custom call;
5. keeps the sharding that abstract evaluation promised under explicit mesh axes.

Importing this module registers the rules; `jax_tiled/__init__.py` does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax import lax
from jax.interpreters import mlir
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

from jax_tiled import _canonical, _compat, _ffi, _presets, _sharding
from jax_tiled._ffi import PRECISION_CODES
from jax_tiled._primitive import check_kernel_runs, tiled_matmul_p


@dataclasses.dataclass(frozen=True)
class Product:
    """Static description of one FFI call; all that the partitioning rule needs."""

    target: str
    transpose_a: bool
    transpose_b: bool
    out_dtype: np.dtype
    precision: int  # the FFI attribute's code (_ffi.PRECISION_CODES)
    kernel: str
    # Operands passed as (stack, batch, rows, cols) and an int32 index each
    # (`_stacked_source`), a's first.
    a_stacked: bool = False
    b_stacked: bool = False
    # SMs the CUDA kernel leaves free for a transfer running beside it (a ring's
    # products, `overlap.Settings.spare_sms`).
    spare_sms: int = 0
    # > 1: the operands are parts laid along K (an emulation preset's,
    # `_presets.PartsLaid`), this many products of parts a chunk group.
    laid_terms: int = 1


def ffi_product(a, b, product: Product, out_dtype, *stack_indices):
    """The FFI call on canonical operands (batch of 1 or B; see _canonical),
    or stacks of them with their indices, into `out_dtype`, with its
    attributes as explicit numpy scalars. On CUDA the operands pass an
    optimization barrier first: XLA's dynamic-slice
    fusion would otherwise wrap a call whose operand is a slice, such as
    `ws[i]` in a `lax.scan` over stacked weights, in a thunk that computes the
    slice's offset on the host at every step, which cost 8 us a call on an
    H100, where copying the slice costs one small kernel (cpp/cuda/NOTES.md,
    "Small products in lax.scan")."""
    batch, m, n, _ = _canonical.problem_dims(
        a.shape[product.a_stacked :],
        b.shape[product.b_stacked :],
        product.transpose_a,
        product.transpose_b,
    )
    if product.target == _ffi.TARGETS["cuda"]:
        a, b = lax.optimization_barrier((a, b))
    call = jax.ffi.ffi_call(product.target, jax.ShapeDtypeStruct((batch, m, n), out_dtype))
    cuda_only = (
        dict(spare_sms=np.int32(product.spare_sms), laid_terms=np.int32(product.laid_terms))
        if product.target == _ffi.TARGETS["cuda"]
        else {}
    )
    return call(
        a,
        b,
        *stack_indices,
        transpose_a=np.bool_(product.transpose_a),
        transpose_b=np.bool_(product.transpose_b),
        precision=np.int32(product.precision),
        kernel=product.kernel,
        **cuda_only,
    )


_partitioned_product = _sharding.partitioned(ffi_product)


def _defining_op(value):
    """The operation that produced `value`, or None for a block argument."""
    return getattr(value.owner, "operation", None)


def _static_shape(value) -> list[int] | None:
    shape = ir.RankedTensorType(value.type).shape
    return None if any(ir.ShapedType.is_dynamic_size(d) for d in shape) else shape


def _leading_axes_merged(value):
    """`value` with reshapes that only add, drop or merge its leading axes (as
    `matmul` reaches the canonical form) looked through."""
    shape = _static_shape(value)
    op = _defining_op(value)
    while op is not None and op.name == "stablehlo.reshape":
        inner = op.operands[0]
        inner_shape = _static_shape(inner)
        if inner_shape is None or len(inner_shape) < 2 or inner_shape[-2:] != shape[-2:]:
            break
        value, op = inner, _defining_op(inner)
    return value


def _swapped_source(value):
    """If `value` (B, Y, X) is an array (..., X, Y) with its last two axes
    swapped (a transpose, maybe behind reshapes of its leading axes), that
    array; else None."""
    if _static_shape(value) is None:
        return None
    op = _defining_op(_leading_axes_merged(value))
    if op is None or op.name != "stablehlo.transpose":
        return None
    rank = len(ir.RankedTensorType(op.operands[0].type).shape)
    swap_last = list(range(rank - 2)) + [rank - 1, rank - 2]
    if list(ir.DenseI64ArrayAttr(op.attributes["permutation"])) != swap_last:
        return None
    return op.operands[0]


def _unsharded(aval) -> bool:
    spec = getattr(getattr(aval, "sharding", None), "spec", ())
    return all(axis is None for axis in spec)


def _stored_form(value, aval, transposed: bool):
    """(source, aval, transposed) for a canonical operand (value, aval,
    transposed) that is a transpose of its last two axes: the untransposed
    array (maybe still of more than three axes), its aval as three axes, and
    the flag flipped. None for other operands, dynamic shapes, and operands
    whose type carries explicit sharding."""
    source = _swapped_source(value)
    if source is None or not _unsharded(aval):
        return None
    batch, rows, cols = _static_shape(value)
    return source, aval.update(shape=(batch, cols, rows)), not transposed


def _as_three_axes(value, aval):
    """`value` reshaped to `aval`'s three axes (free: its leading axes merge)."""
    three = ir.RankedTensorType.get(list(aval.shape), ir.RankedTensorType(value.type).element_type)
    return value if value.type == three else stablehlo.reshape(three, value)


def reads_as_stored(platform, kernel, run, stored, copied) -> bool:
    """Whether a product whose operands XLA would transpose first runs on them
    as stored, through the kernel's transpose flags instead: `stored` is its
    problem so, `copied` after the copy (copies_b_k_major's problem tuples),
    `run` the resolved preset (`_presets.resolve`).

    Where the kernel that runs it reads transposes as fast as plain layouts
    (the kernel table's `reads_transposes`: the CPU kernel, CUDA's `mma` and
    `wgmma`) the copy is a pass over the operand for nothing: on an H100 a
    kernel that took about a tenth of a 4096^3 product's time, 1.7-1.8 times
    that of a 64 x 4096 x 14336 product read as stored, and 2.3-2.8 us with a
    launch before every small one (cpp/cuda/NOTES.md, "Transposed operands
    read as stored"). So also where the plan reads them faster than the copy
    and the product on it would take (CudaPlan's `reads_transposes`:
    warptile's one row or column, which reads its matrix once either way,
    where the copy reads and writes it once more). For `auto` that kernel
    must be its choice both ways: as stored, rows the copy engine cannot read
    would send it to another. And not where the lowering would then copy b
    instead (copies_b_k_major: float32's `a.T @ b` on wgmma), which saves
    nothing."""
    if platform != "cuda":
        return all(k.reads_transposes for k in _ffi.kernel_table(platform))
    dtypes = (np.dtype(run.operand_dtype).name, np.dtype(run.product_dtype).name)
    if kernel == "auto":
        name, name_copied = (
            _ffi.cuda_explain(*dtypes, problem, _ffi.cuda_multiprocessors(), run.precision)[0]
            for problem in (stored, copied)
        )
        if name != name_copied:
            return False
        if not name:  # nothing to compute (an empty output, K of 0): no copy either
            return True
    elif _ffi.refusal(platform, kernel, *dtypes, stored, run.precision):
        return False
    else:
        name = kernel
    plan = _ffi.cuda_plan(name, *dtypes, stored, run.precision)
    if plan is None:  # nothing to compute
        return True
    return plan.reads_transposes and not copies_b_k_major(
        platform, kernel, *dtypes, run.precision, stored
    )


def _problem(a_operand, b_operand) -> tuple:
    """copies_b_k_major's problem tuple for canonical (value, aval, transposed) operands."""
    (_, a_aval, transpose_a), (_, b_aval, transpose_b) = a_operand, b_operand
    _batch, m, n, k = _canonical.problem_dims(a_aval.shape, b_aval.shape, transpose_a, transpose_b)
    return (a_aval.shape[0], b_aval.shape[0], m, n, k, transpose_a, transpose_b)


def _stacked_source(value, aval):
    """If the canonical operand `value` (B, Y, X) is one slice of an array
    (L, ..., Y, X) along its leading axis with a static index (`ws[3]`, a
    `stablehlo.slice` taking the whole of every other axis), maybe behind
    reshapes of its leading axes: that array reshaped to (L, B, Y, X) (free,
    row-major) and the index as an int32 constant, for a kernel that reads the
    slice in place where XLA would copy it first. Else None, as for dynamic
    shapes and operands whose type carries explicit sharding.

    Slices with a traced index are left to XLA. In a `lax.scan` the lowering
    cannot see them (scan slices its inputs in a function of its own), and
    in a `fori_loop` body read in place the loop body had one operation too
    few for XLA to capture it into a CUDA graph (fewer than
    `xla_gpu_graph_min_graph_size`), which cost more than the copy saves
    (cpp/cuda/NOTES.md, "Slices of stacked weights read in place")."""
    shape = _static_shape(value)
    if shape is None or not _unsharded(aval):
        return None
    op = _defining_op(_leading_axes_merged(value))
    if op is None or op.name != "stablehlo.slice":
        return None
    source = op.operands[0]
    source_shape = _static_shape(source)
    if source_shape is None or len(source_shape) < 3 or source_shape[-2:] != shape[-2:]:
        return None
    starts, limits, strides = (
        list(ir.DenseI64ArrayAttr(op.attributes[name]))
        for name in ("start_indices", "limit_indices", "strides")
    )
    whole_rest = starts[1:] == [0] * (len(starts) - 1) and limits[1:] == source_shape[1:]
    if not (whole_rest and limits[0] - starts[0] == 1 and strides == [1] * len(strides)):
        return None
    stack_type = ir.RankedTensorType.get(
        [source_shape[0], *shape], ir.RankedTensorType(value.type).element_type
    )
    if source.type != stack_type:
        source = stablehlo.reshape(stack_type, source)
    return source, mlir.ir_constant(np.int32(starts[0]))


def reads_stacks_in_place(platform, kernel, operand_dtype, product_dtype, precision, problem):
    """Whether the kernel that runs `problem` (as copies_b_k_major takes it)
    reads an operand given as a slice of a stack in place: the table's
    `stack_slices` of the forced kernel, or of auto's choice (unknown, so
    False, for symbolic dimensions under `jax.export`). The CUDA handler
    would gather the slice for the other kernels, a kernel launch in place of
    XLA's copy (a memcpy node in a CUDA graph) and no faster: those slices are
    left to XLA."""
    table = {k.name: k for k in _ffi.kernel_table(platform)}
    if kernel == "auto":
        if platform != "cuda":
            return all(k.stack_slices for k in table.values())
        if not all(isinstance(d, (int, np.integer)) for d in problem[:5]):
            return False
        kernel, _, _ = _ffi.cuda_explain(
            np.dtype(operand_dtype).name,
            np.dtype(product_dtype).name,
            problem,
            _ffi.cuda_multiprocessors(),
            precision,
        )
    return kernel in table and table[kernel].stack_slices


def copies_b_k_major(platform, kernel, operand_dtype, product_dtype, precision, problem) -> bool:
    """Whether the call takes b through XLA's transpose (stored (n, k)) before
    the kernel: for `auto`, float32 on the tensor cores (DEFAULT, HIGH) with a
    stored (k, m) and b stored (k, n), the weight gradient's layout, where
    auto would run the product so copied on `wgmma` (a Hopper GPU, not a
    small product; `problem` is (batch_a, batch_b, m, n, k, transpose_a,
    transpose_b)). TF32 `wgmma` reads its shared-memory operand K-major only;
    as stored, it rewrites every B slab in shared memory on 128 x 128 tiles
    (one TF32 pass; 3xTF32 not at all), 0.77 ms at 4096^3 on an H100 against
    0.46 ms for the transpose and the product on b K-major (cpp/cuda/NOTES.md,
    "The weight gradient's layout on TF32 wgmma"). A forced kernel runs the
    layout as given."""
    transpose_a, transpose_b = problem[-2:]
    if not (
        platform == "cuda"
        and kernel == "auto"
        and transpose_a
        and not transpose_b
        and np.dtype(operand_dtype) == np.float32
        and precision in (lax.Precision.DEFAULT, lax.Precision.HIGH)
        and _ffi.cuda_compute_capability() == _ffi.HOPPER
    ):
        return False
    auto_runs, _, _ = _ffi.cuda_explain(
        np.dtype(operand_dtype).name,
        np.dtype(product_dtype).name,
        (*problem[:5], transpose_a, True),
        _ffi.cuda_multiprocessors(),
        precision,
    )
    return auto_runs == "wgmma"


# The kernels that load operand rows as whole 16-byte lines (LaunchPlan's
# reads_whole_lines): the TMA copy engine reads rows (and batches) that start
# at multiples of 16 bytes (cuTensorMapEncodeTiled's strides), warptile's
# float32 mainloop loads four floats of a row as one 16-byte access.
LINE_BYTES = 16


# On the SIMT kernels (HIGHEST) the float32 mainloop is 1.2-1.5x the speed of
# the kernel for every product, so the padding's copies pay for themselves
# only where the product does at least this many FLOPs a byte they write.
# Measured on an H100 (2026-11-28, cpp/cuda/NOTES.md, "Odd rows padded for
# the float32 mainloop"): padded, 1001x4097x1003 (224 FLOPs a byte) ran 1.2x
# the speed as given, 3000x1000x2999 (375) 1.17x, 2047x2049x2051 (343) 1.46x,
# 4095^3 (683) 1.27x; 777x1999x513 (134) ran 0.93x, 16x8193x8191 (8) 0.83x.
SIMT_PADDING_FLOPS_PER_BYTE = 192


def _auto_plan(operand_dtype, product_dtype, precision, problem):
    """(kernel, plan) that `auto` runs `problem` with (plan None: nothing runs)."""
    dtypes = (np.dtype(operand_dtype).name, np.dtype(product_dtype).name)
    kernel = _ffi.cuda_explain(*dtypes, problem, _ffi.cuda_multiprocessors(), precision)[0]
    return kernel, kernel and _ffi.cuda_plan(kernel, *dtypes, problem, precision)


def _padding_bytes(operand_dtype, product_dtype, problem, padded) -> int:
    """The bytes the padding of `problem` to `padded` (m, n, k) writes: each
    operand whose shape changes, and the result where it is sliced back."""
    batch_a, batch_b, m, n, k = problem[:5]
    pm, pn, pk = padded
    operand, product = np.dtype(operand_dtype).itemsize, np.dtype(product_dtype).itemsize
    written = 0
    if (pm, pk) != (m, k):
        written += batch_a * pm * pk * operand
    if (pk, pn) != (k, n):
        written += batch_b * pk * pn * operand
    if (pm, pn) != (m, n):
        written += max(batch_a, batch_b) * m * n * product
    return written


def padding_to_whole_lines(
    platform, kernel, operand_dtype, product_dtype, precision, problem
) -> tuple[int, int, int] | None:
    """(m, n, k) rounded up so that each operand's rows as stored are whole
    16-byte lines, where `auto` would run `problem` (copies_b_k_major's tuple)
    on a plan that reads any rows only because they are not, and on one that
    loads whole lines once padded (LaunchPlan's reads_whole_lines: `wgmma`,
    warptile's float32 mainloop): the operands are then padded with zeros
    (exact: a padded K pairs zeros with zeros, padded rows and columns of the
    result are dropped). On an H100 such 16-bit and TF32 products ran on `mma`
    at 0.33-0.43x jnp's time (777x1999x513, 3000x1000x2999 bfloat16), where
    the padding copies the operands once (cpp/cuda/NOTES.md, "Odd rows padded
    for the copy engine"); on the SIMT kernels only where the product does at
    least SIMT_PADDING_FLOPS_PER_BYTE FLOPs a byte the padding writes. None
    where nothing would change, for a forced kernel (it runs the product as
    given), and for symbolic dimensions."""
    if platform != "cuda" or kernel != "auto" or _ffi.cuda_compute_capability() != _ffi.HOPPER:
        return None
    if not all(isinstance(d, (int, np.integer)) for d in problem[:5]):
        return None
    batch_a, batch_b, m, n, k, transpose_a, transpose_b = problem
    step = LINE_BYTES // np.dtype(operand_dtype).itemsize

    def whole_lines(size):
        return -(-size // step) * step

    # The axis each operand is stored along: a (m, k) or (k, m), b (k, n) or (n, k).
    padded = (
        whole_lines(m) if transpose_a else m,
        n if transpose_b else whole_lines(n),
        whole_lines(k) if transpose_b or not transpose_a else k,
    )
    if padded == (m, n, k):
        return None
    (_, as_given), (kernel_padded, once_padded) = (
        _auto_plan(
            operand_dtype,
            product_dtype,
            precision,
            (batch_a, batch_b, *dims, transpose_a, transpose_b),
        )
        for dims in ((m, n, k), padded)
    )
    # warptile's row blocks (1-row blocks: one row, or one column as the
    # transposed product's row) read the matrix once in either layout; a
    # padded vector would only add a copy and send the product to a plan of
    # tiles (cpp/cuda/NOTES.md, "Row blocks' parts of K by the blocks an SM holds").
    if as_given and (as_given.reads_whole_lines or as_given.block_m == 1):
        return None
    if not (once_padded and once_padded.reads_whole_lines):
        return None
    (facts,) = (f for f in _ffi.kernel_table("cuda") if f.name == kernel_padded)
    flops = 2 * max(batch_a, batch_b) * m * n * k
    written = _padding_bytes(operand_dtype, product_dtype, problem, padded)
    if not facts.tensor_cores and flops < SIMT_PADDING_FLOPS_PER_BYTE * written:
        return None
    return padded


def _padded(a, b, padded, transpose_a, transpose_b):
    """Canonical operands (batch, rows, cols) padded with zeros at the end of
    each axis to `padded` (m, n, k)."""
    pm, pn, pk = padded
    a_to = (pk, pm) if transpose_a else (pm, pk)
    b_to = (pn, pk) if transpose_b else (pk, pn)

    def pad(x, to):
        if tuple(to) == x.shape[1:]:
            return x
        config = [(0, 0, 0)] + [(0, want - have, 0) for want, have in zip(to, x.shape[1:])]
        return lax.pad(x, np.zeros((), x.dtype), config)

    return pad(a, a_to), pad(b, b_to)


# Small products in parts of K summed by XLA (k_parts_summed_by_xla): the
# counts of parts tried, fewest first, the most bytes of K a part is given,
# and the sizes the rule holds for (measured on one H100, 2026-11-27:
# cpp/cuda/NOTES.md, "K in parts summed by XLA").
XLA_K_PARTS = (2, 4, 8)
XLA_K_PART_BYTES = 256
XLA_K_PARTS_SIZES = (256, 512)


def k_parts_summed_by_xla(platform, kernel, operand_dtype, product_dtype, precision, problem):
    """How many parts of K `auto` cuts a small float32 product into (1: none),
    each part a product of its own in one batched call into float32, their
    sum left to XLA: XLA fuses the sum and the elementwise work after it (an
    activation) into one kernel, and the regrouping of a non-transposed `a`
    into the kernel that made it, where K whole in one call left most SMs
    idle. On an H100, chains of x = tanh(x @ w) in lax.scan ran 9.4 and 14.8
    us a product at 256^2 and 512^2 where K whole took 12.2 and 19.3 (jnp 6.9
    and 11.9); unrolled, 10.7 where K whole took 17.3 at 512^2. Not for
    16-bit operands, nor below 256: there the parts' extra nodes cost XLA's
    command buffers more than the parts saved (cpp/cuda/NOTES.md, "K in parts
    summed by XLA"). For one unbatched product (batch_a = batch_b = 1) on a
    Hopper GPU at DEFAULT precision (TF32) with float32 operands and result,
    m, n and k within XLA_K_PARTS_SIZES: the fewest parts of XLA_K_PARTS each
    at most XLA_K_PART_BYTES of K deep, in whole 16-byte lines; not where the
    operands are padded for the copy engine or b is copied K-major
    (padding_to_whole_lines, copies_b_k_major). Forced kernels and
    symbolic dimensions run K whole."""
    if platform != "cuda" or kernel != "auto" or _ffi.cuda_compute_capability() != _ffi.HOPPER:
        return 1
    if not all(isinstance(d, (int, np.integer)) for d in problem[:5]):
        return 1
    batch_a, batch_b, m, n, k, _, _ = problem
    operand, product = np.dtype(operand_dtype), np.dtype(product_dtype)
    smallest, largest = XLA_K_PARTS_SIZES
    if (
        (batch_a, batch_b) != (1, 1)
        or precision != lax.Precision.DEFAULT
        or operand != np.float32
        or product != np.float32
        or not all(smallest <= d <= largest for d in (m, n, k))
    ):
        return 1
    line = LINE_BYTES // operand.itemsize
    parts = next(
        (
            p
            for p in XLA_K_PARTS
            if k % p == 0 and k // p % line == 0 and k // p * operand.itemsize <= XLA_K_PART_BYTES
        ),
        1,
    )
    laid_otherwise = (padding_to_whole_lines, copies_b_k_major)
    if parts > 1 and any(
        rule(platform, kernel, operand_dtype, product_dtype, precision, problem)
        for rule in laid_otherwise
    ):
        return 1
    return parts


def in_k_parts(a, b, parts, transpose_a, transpose_b):
    """Canonical operands (1, rows, cols) as `parts` products along K: a batch
    of `parts` (a's K-th part with b's). Reshapes where K is the operand's
    leading axis (a stored (k, m), b stored (k, n)), a transpose otherwise."""
    (_, *a_dims), (_, *b_dims) = a.shape, b.shape

    def split(x, dims, k_leading):
        rows, cols = dims
        if k_leading:  # (k, x): each part is rows of it
            return x.reshape(parts, rows // parts, cols)
        return x.reshape(rows, parts, cols // parts).transpose(1, 0, 2)

    return split(a, a_dims, transpose_a), split(b, b_dims, not transpose_b)


def _lowering(ctx, a, b, *, platform, transpose_a, transpose_b, out_dtype, precision, kernel):
    available = _ffi.kernel_names(platform)
    if kernel != "auto" and kernel not in available:
        raise ValueError(
            f"jax_tiled: kernel {kernel!r} is not available on {platform}; "
            f"valid: {['auto', *available]}"
        )
    (out_aval,) = ctx.avals_out
    # A preset becomes casts around a product at one of the kernels' modes, for
    # this platform (a preset it refuses raises ValueError here).
    run = _presets.resolve(platform, precision, ctx.avals_in[0].dtype, out_aval.dtype)
    if run.split is not None:
        return _lower_split(ctx, a, b, run, out_aval, transpose_a, transpose_b, kernel, platform)
    # Operands that are transposes, read as stored where reads_as_stored.
    given = [(a, ctx.avals_in[0], transpose_a), (b, ctx.avals_in[1], transpose_b)]
    folds = [_stored_form(*operand) for operand in given]
    stored = [fold or operand for fold, operand in zip(folds, given)]
    if any(folds) and reads_as_stored(platform, kernel, run, _problem(*stored), _problem(*given)):
        a, b = (_as_three_axes(*fold[:2]) if fold else v for fold, (v, _, _) in zip(folds, given))
        (_, a_aval, transpose_a), (_, b_aval, transpose_b) = stored
        ctx = ctx.replace(avals_in=[a_aval, b_aval])
    a_aval, b_aval = ctx.avals_in
    _batch, m, n, k = _canonical.problem_dims(a_aval.shape, b_aval.shape, transpose_a, transpose_b)
    batches = (a_aval.shape[0], b_aval.shape[0])
    copy_b = copies_b_k_major(
        platform,
        kernel,
        run.operand_dtype,
        run.product_dtype,
        run.precision,
        (*batches, m, n, k, transpose_a, transpose_b),
    )
    if copy_b:
        transpose_b = True
        b_aval = b_aval.update(shape=(*b_aval.shape[:-2], b_aval.shape[-1], b_aval.shape[-2]))
    check_kernel_runs(
        platform,
        kernel,
        run.operand_dtype,
        run.product_dtype,
        (*batches, m, n, k, transpose_a, transpose_b),
        run.precision,
    )
    product = Product(
        target=_ffi.TARGETS[platform],
        transpose_a=transpose_a,
        transpose_b=transpose_b,
        out_dtype=run.product_dtype,
        precision=PRECISION_CODES[run.precision],
        kernel=str(kernel),
        laid_terms=run.laid_terms,
    )

    wide = _presets.needs_x64(run)
    problem = (*batches, m, n, k, transpose_a, transpose_b)
    # Padded on one device only: sharded operands are the partitioner's, whose
    # blocks would each need their own padding.
    padded = None
    if not wide and _compat.lowers_for_one_device(ctx):
        padded = padding_to_whole_lines(
            platform, kernel, run.operand_dtype, run.product_dtype, run.precision, problem
        )

    # K in parts summed by XLA. The rule refuses a product whose b is copied
    # K-major when asked of the problem as given (as explain asks it); here
    # the problem is b's copy's, so the copy is tested first.
    parts = 1
    if not copy_b and _compat.lowers_for_one_device(ctx):
        parts = k_parts_summed_by_xla(
            platform, kernel, run.operand_dtype, run.product_dtype, run.precision, problem
        )

    # Slices of stacked arrays read in place: on one device only (a stack's
    # sharding is the partitioner's business), where the operand's dtype is
    # the kernel's (a cast would convert the whole stack), and where the
    # kernel reads it so; not where the operands are padded (copied anyway)
    # or taken in parts of K.
    stacks = [None, None]
    if not wide and padded is None and parts == 1 and _compat.lowers_for_one_device(ctx):
        for i, (value, aval) in enumerate(zip((a, b), ctx.avals_in)):
            if np.dtype(aval.dtype) == run.operand_dtype and not (i == 1 and copy_b):
                stacks[i] = _stacked_source(value, aval)
    if stacks != [None, None] and reads_stacks_in_place(
        platform, kernel, run.operand_dtype, run.product_dtype, run.precision, problem
    ):
        return _lower_stacked(ctx, a, b, stacks, product, out_aval)

    def partitioned(a, b):
        with jax.named_scope("tiled_matmul"):  # what profiles and HLO dumps name the call
            a, b = (lax.convert_element_type(x, run.operand_dtype) for x in (a, b))
            if copy_b:
                b = jax.numpy.swapaxes(b, -1, -2)
            if padded:
                a, b = _padded(a, b, padded, transpose_a, transpose_b)
                out = _partitioned_product(a, b, product)[:, :m, :n]
            elif parts > 1:
                # The rule takes float32 results only: the parts' sum is the result.
                a, b = in_k_parts(a, b, parts, transpose_a, transpose_b)
                out = ffi_product(a, b, product, product.out_dtype).sum(0, keepdims=True)
            elif wide:
                # The partitioning callbacks trace later, with float64 off again:
                # the bare call instead (XLA gathers sharded operands for it).
                out = ffi_product(a, b, product, product.out_dtype)
            else:
                out = _partitioned_product(a, b, product)
            return lax.convert_element_type(out, out_aval.dtype)

    with _presets.wide_types(run):
        (out,) = mlir.lower_fun(partitioned, multiple_results=False)(ctx, a, b)
    # Under explicit axes, keep the sharding that abstract evaluation promised.
    return [_compat.lower_with_sharding_in_types(ctx, out, out_aval)]


def split_on_gpu(x, split: _presets.Split, side: int, k_minor: bool):
    """`_presets.split_operand` of a canonical operand (batch, rows, cols),
    K along its rows where `k_minor`, else down its columns, by the CUDA
    split (cpp/cuda/blocks/split_parts.cuh): one pass over the operand,
    where XLA's fusions of the same layout made two and took X3 11% longer
    at 4096^3 (cpp/cuda/NOTES.md, "A split of our own"). The same bits but for a
    subnormal lower part, which it keeps and XLA's GPU code flushes to
    zero. bfloat16 splits into two parts only."""
    batch, rows, cols = x.shape
    terms = len(split.terms)
    shape = (batch, rows, cols * terms) if k_minor else (batch, rows * terms, cols)
    codes = np.array([_presets.part_taken(t, side) for t in split.terms], np.int32)
    call = jax.ffi.ffi_call("tiled_split_parts_cuda", jax.ShapeDtypeStruct(shape, split.dtype))
    return call(x, k_minor=bool(k_minor), terms=codes, chunk=np.int32(split.chunk))


def _lower_split(ctx, a, b, run, out_aval, transpose_a, transpose_b, kernel, platform):
    """An emulation preset's product (`_presets.Split`): the operands' parts
    laid along K, then the product of the parts as a product of its own, at
    the kernel precision the parts take; its lowering (this rule, for a
    lax.Precision) reads layouts, partitions and picks the kernel as for any
    product. On one CUDA device our kernel splits each operand
    (`split_on_gpu`); elsewhere XLA fuses the split of each operand into one
    pass (sharded operands are the partitioner's, which splits each block of
    them where it lies)."""
    ours = (
        platform == "cuda"
        and run.split.dtype == _presets.BF16
        and run.split.parts == 2
        and _compat.lowers_for_one_device(ctx)
        and all(isinstance(d, (int, np.integer)) for v in ctx.avals_in for d in v.shape)
    )

    def split(x, side, k_minor):
        if ours:
            return split_on_gpu(x, run.split, side, k_minor)
        return _presets.split_operand(x, run.split, side, -1 if k_minor else -2)

    def split_product(a, b):
        with jax.named_scope("tiled_matmul_split"):
            a, b = (lax.convert_element_type(x, run.operand_dtype) for x in (a, b))
            parts_a = split(a, 0, k_minor=not transpose_a)
            parts_b = split(b, 1, k_minor=transpose_b)
            out = tiled_matmul_p.bind(
                parts_a,
                parts_b,
                transpose_a=transpose_a,
                transpose_b=transpose_b,
                out_dtype=run.product_dtype,
                precision=_presets.PartsLaid(len(run.split.terms)),
                kernel=kernel,
            )
            return lax.convert_element_type(out, out_aval.dtype)

    (out,) = mlir.lower_fun(split_product, multiple_results=False)(ctx, a, b)
    return [_compat.lower_with_sharding_in_types(ctx, out, out_aval)]


def _lower_stacked(ctx, a, b, stacks, product: Product, out_aval):
    """The bare FFI call with operands given as stacks (`_stacked_source`) and
    their indices: one device, and the operands already in the kernel's dtype."""
    operands, avals, indices = [], [], []
    for value, aval, stack in zip((a, b), ctx.avals_in, stacks):
        if stack is None:
            operands.append(value)
            avals.append(aval)
        else:
            source, index = stack
            operands.append(source)
            avals.append(aval.update(shape=tuple(ir.RankedTensorType(source.type).shape)))
            indices.append(index)
    product = dataclasses.replace(
        product, a_stacked=stacks[0] is not None, b_stacked=stacks[1] is not None
    )
    index_avals = [jax.core.ShapedArray((), np.int32)] * len(indices)

    def call(a, b, *indices):
        with jax.named_scope("tiled_matmul"):
            out = ffi_product(a, b, product, product.out_dtype, *indices)
            return lax.convert_element_type(out, out_aval.dtype)

    (out,) = mlir.lower_fun(call, multiple_results=False)(
        ctx.replace(avals_in=[*avals, *index_avals]), *operands, *indices
    )
    return [_compat.lower_with_sharding_in_types(ctx, out, out_aval)]


def register(primitive) -> None:
    """Registers `primitive`'s lowering on every platform whose module loaded."""
    _ffi.load_all()
    # custom_partitioning's lowering needs the device assignment, which jit only
    # hands to lowering rules of primitives that declare they need it.
    _compat.require_devices_during_lowering(primitive)
    # The lowering is not cached: a cached lowering sees its operands as
    # arguments of a function of its own, so _stored_form and
    # _stacked_source could not see their producers.
    platforms = ["cpu", "cuda"] if _ffi.cuda_module_built() else ["cpu"]
    for platform in platforms:
        mlir.register_lowering(
            primitive,
            functools.partial(_lowering, platform=platform),
            platform=platform,
            cacheable=False,
        )


register(tiled_matmul_p)
