"""Per-device collective products: rings of `ppermute`s whose transfers overlap the products.

These run inside the partitioned lowering (`_sharding._partition`), on each
device's blocks, with the mesh axes of the ring bound as manual axes. Each ring
step's product depends only on local data, and each transfer only on the
previous step, so XLA's scheduler can run the transfer of one step while the
kernel computes the next (on GPU, collective-permutes are asynchronous). The
schedule is static: every device adds the same partial products in the same
order on every run.

Operands are in the canonical stored layout of `_canonical`: a is (Ba, M, K) or
(Ba, K, M), b is (Bb, K, N) or (Bb, N, K), the result (B, M, N).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_tiled import _canonical

RESULT_DIM = {"batch": 0, "m": 1, "n": 2}


def _size(mesh_shape, axes) -> int:
    return math.prod(mesh_shape[x] for x in axes)


def _pad_to(x, dim, size):
    if x.shape[dim] >= size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[dim] = (0, size - x.shape[dim])
    return jnp.pad(x, widths)


def _rows(take, x, start, size):
    """Rows [start, start + size) of x along the ring's dimension, or x itself
    where it has none (`take` None: see `_padded_slicers`), as an operand of
    `_call`: (the rows, None), or (a stack of such rows, the index of these)."""
    return (x, None) if take is None else take(start, size)


def _call(call, a, b, product, out_dtype):
    """`call` on operands each given as (array, None) or (stack, int32 index)
    (`_rows`): a stack goes to the FFI call with its index, as
    `_lowering.ffi_product` takes it, and the kernel reads the slice in place
    where it can (the CUDA handler copies it out for the others), where XLA
    would copy each slice before the call."""
    (a, a_index), (b, b_index) = a, b
    indices = [index for index in (a_index, b_index) if index is not None]
    if indices:
        product = dataclasses.replace(
            product, a_stacked=a_index is not None, b_stacked=b_index is not None
        )
    return call(a, b, product, out_dtype, *indices)


def _as_stack(x, dim, rows):
    """x (B, Y, X) cut along `dim` into slices of `rows` as a stack (L, B', Y',
    X) (free: row-major), where each slice is contiguous (the batch axis, or
    Y of a batch of one) and `rows` divides the axis; else None."""
    if x.shape[dim] % rows or not (dim == 0 or (dim == 1 and x.shape[0] == 1)):
        return None
    count = x.shape[dim] // rows
    return x.reshape((count, rows, *x.shape[1:]) if dim == 0 else (count, 1, rows, x.shape[2]))


def reduce_scatter_ring(
    call,
    product,
    a,
    b,
    *,
    axes,
    n,
    factor,
    dims,
    pieces,
    gather,
    acc_dtype,
    beside_transfer,
    send_dtype=None,
):
    """sum over the devices of `axes` of `call(a, b)`, chunked along the result's
    `factor` dimension: device i ends with block i of that sum (a reduce-scatter),
    or with every block when `gather` (an all-reduce, as reduce-scatter then
    all-gather of the rounded blocks, so the gather moves out_dtype, not float32).

    Block j of the result is the rows [j * block, (j + 1) * block) of the factor's
    dimension, block = ceil(size / n); each block is cut into `pieces` of `q` rows
    and each piece has its own ring, so that the all-gather of one piece can run
    behind the products of the next. A piece that runs past its block (q does not
    divide block) computes rows that are dropped; operands are padded so that no
    slice is clamped.

    Ring step s on device i computes its partial product for block (i - 1 - s) mod
    n and adds it to the running sum received from device i - 1, so the sum for
    block i completes on device i after n - 1 transfers, each of which can hide
    behind the next step's product. Every product but the first runs beside a
    transfer (the previous step's, or the previous piece's gather) and is
    described by `beside_transfer` (`product` with SMs left to the transfer).

    The running sums travel in `send_dtype` (None: acc_dtype): where it is
    narrower, each device rounds its sum to it before sending (its first
    product is computed straight into it) and adds what it receives in
    acc_dtype (overlap.Settings.k_sums).
    """
    rounds_sums = send_dtype is not None and np.dtype(send_dtype) != np.dtype(acc_dtype)
    size, block = _blocks(a, b, dims, factor, n)
    q = -(-block // pieces)
    a, b, take_a, take_b = _padded_slicers(
        a, b, dims, factor, (n - 1) * block + pieces * q, stack_rows=q if block % q == 0 else None
    )

    index = lax.axis_index(axes)
    forward = [(j, (j + 1) % n) for j in range(n)]
    results = []
    for p in range(pieces):
        total = None
        for s in range(n):
            start = ((index - 1 - s) % n) * block + p * q
            first = p == 0 and s == 0
            sent = rounds_sums and s < n - 1
            partial = _call(
                call,
                _rows(take_a, a, start, q),
                _rows(take_b, b, start, q),
                product if first else beside_transfer,
                send_dtype if sent and s == 0 else acc_dtype,
            )
            if total is not None:
                received = lax.ppermute(total, axes, forward)
                partial = (received.astype(acc_dtype) if rounds_sums else received) + partial
            total = partial.astype(send_dtype) if sent else partial
        piece = total.astype(product.out_dtype)
        if gather:
            # Each piece's gather starts as soon as its ring ends, so that it runs
            # behind the next piece's products; a ring of ppermutes as well, so
            # that the program holds no all-gather, whose presence then flags an
            # operand gathered by the partitioner.
            piece = _gather_blocks(piece, axes, n, index, forward)
        results.append(piece)
    return _assemble(results, n=n, block=block, size=size, factor=factor, gather=gather)


def operand_ring(call, product, a, b, *, axes, n, factor, dims, gather, acc_dtype, beside_transfer):
    """The sum `reduce_scatter_ring` computes, moving the operands instead of
    the partial sums: device i computes block i of the result (blocked as
    there, in one piece) over every device's slice of K, from each device j's
    operands for that slice. An operand that holds the factor's dimension (a
    for M, b for N, both for a batch that neither broadcasts) is sent in
    pieces, device j sending device i its rows of block i; one that does not is
    sent whole. Step s receives from device i - s directly (`ppermute` by s
    places), so no transfer waits on another or on a product, and all of
    them can run beside the products.

    The bytes, per device, for bfloat16 at m x k x n over d devices: (d - 1)(m
    k / d^2 + k n / d) values of the input type, against (d - 1) m n / d
    float32 sums: fewer where k is not much above m and n (8192^3 on two
    devices: 101 MB against 134; on four, 126 against 201). The partial sums
    stay in `acc_dtype` on the device that adds them, in the order of the
    steps, so a 16-bit result is rounded once, as by `reduce_scatter_ring`.
    Every product but the last runs beside a transfer and is described by
    `beside_transfer`.
    """
    size, block = _blocks(a, b, dims, factor, n)
    a, b, take_a, take_b = _padded_slicers(a, b, dims, factor, n * block)
    index = lax.axis_index(axes)

    def received(take, operand, s):
        """What device i gets at step s from device i - s: its rows of block i,
        or its operand whole."""
        mine, _ = _rows(take, operand, ((index + s) % n) * block, block)  # no stacks: sent
        return mine if s == 0 else lax.ppermute(mine, axes, [(j, (j + s) % n) for j in range(n)])

    incoming = [(received(take_a, a, s), received(take_b, b, s)) for s in range(n)]
    total = None
    for s in range(n):
        partial = call(*incoming[s], beside_transfer if s < n - 1 else product, acc_dtype)
        if s < n - 1:
            # The next step's operands and this product made ready together
            # (see `all_gather_ring`): without it XLA's scheduler ended every
            # transfer before the first product.
            partial, incoming[s + 1] = lax.optimization_barrier((partial, incoming[s + 1]))
        total = partial if total is None else total + partial
    block_result = total.astype(product.out_dtype)
    if gather:
        forward = [(j, (j + 1) % n) for j in range(n)]
        block_result = _gather_blocks(block_result, axes, n, index, forward)
    return _assemble([block_result], n=n, block=block, size=size, factor=factor, gather=gather)


def collective_pieces(
    call, product, a, b, *, axes, dims, scatter, across, pieces, sum_dtype, beside_transfer
):
    """The sum over the devices of `axes` of `call(a, b)`, reduce-scattered
    along the result's dimension `scatter` (0, 1, 2: batch, M, N) or, where it
    is None, all-reduced: `pieces` products, near-equal static slices of the
    result along `across` ("m" or "n", not the scattered dimension), each
    computed in `sum_dtype` and summed by one collective in it. A piece's
    collective depends on its product alone, so it can run beside the next
    piece's product (described by `beside_transfer`); the two pass through
    one optimization barrier, as in `all_gather_ring`, so that XLA's
    scheduler, which knows no custom call's time, does not end the
    collective first. Nothing is padded: each piece is a slice of a (along
    M) or of b (along N) of static bounds.
    """
    (_, am, _), (_, _, bn) = dims
    x, dim = (a, am) if across == "m" else (b, bn)
    bounds = _cuts(x.shape[dim], pieces)
    # Equal pieces of contiguous rows: a stack whose slices the kernel reads in place.
    equal = x.shape[dim] % pieces == 0 and len(bounds) - 1 == pieces
    stack = _as_stack(x, dim, bounds[1]) if equal else None
    summed, pending = [], None
    for p, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        piece = (
            (lax.slice_in_dim(x, lo, hi, axis=dim), None) if stack is None else (stack, np.int32(p))
        )
        a_piece, b_piece = (piece, (b, None)) if across == "m" else ((a, None), piece)
        step = product if pending is None else beside_transfer
        partial = _call(call, a_piece, b_piece, step, sum_dtype)
        if pending is not None:
            pending, partial = lax.optimization_barrier((pending, partial))
            summed.append(pending)
        if scatter is None:
            pending = lax.psum(partial, axes)
        else:
            pending = lax.psum_scatter(partial, axes, scatter_dimension=scatter, tiled=True)
    summed.append(pending)
    return jnp.concatenate(summed, axis=RESULT_DIM[across]).astype(product.out_dtype)


def all_gather_pieces(
    call, product, a, b, *, axes, n, gathered, dims, size, pieces, beside_transfer, barrier=True
):
    """What `all_gather_ring` computes, gathering by collectives: each device's
    block of the `gathered` operand is cut into `pieces` near-equal static
    slices, each slice gathered from every device of `axes` by one all-gather
    and multiplied once it is whole. Piece p + 1's all-gather is issued before
    piece p's product, and with `barrier` the two pass through one
    optimization barrier, so that the product runs beside the gather
    (described by `beside_transfer`; the last product overlaps none). A
    gathered piece holds each device's slice in device order, so the
    result's rows (or columns) are put in order by one concatenation and
    reshape at the end.
    """
    (_, am, _), (_, _, bn) = dims
    moving = a if gathered == "a" else b
    dim = am if gathered == "a" else bn
    out_dim = 1 if gathered == "a" else 2
    block = moving.shape[dim]
    bounds = _cuts(block, pieces)
    gather = lambda lo, hi: lax.all_gather(
        lax.slice_in_dim(moving, lo, hi, axis=dim), axes, axis=dim, tiled=True
    )
    incoming = gather(bounds[0], bounds[1])
    results = []
    for p, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        following = gather(*bounds[p + 1 : p + 3]) if p + 2 < len(bounds) else None
        result, following = _beside(
            call, product, a, b, incoming, gathered, following, beside_transfer, barrier
        )
        # (.., n * (hi - lo), ..) as (.., n, hi - lo, ..): device j's rows of the piece.
        shape = list(result.shape)
        results.append(result.reshape(shape[:out_dim] + [n, hi - lo] + shape[out_dim + 1 :]))
        incoming = following
    blocks = jnp.concatenate(results, axis=out_dim + 1)  # (.., n, block, ..)
    shape = list(blocks.shape)
    merged = shape[:out_dim] + [n * block] + shape[out_dim + 2 :]
    return lax.slice_in_dim(blocks.reshape(merged), 0, size, axis=out_dim)


def _cuts(size, pieces):
    """The bounds of `pieces` near-equal slices of `size` rows, fewer where
    there are fewer rows than pieces (no slice is empty)."""
    return sorted({size * p // pieces for p in range(pieces + 1)})


def _beside(call, product, a, b, held, gathered, following, beside_transfer, barrier):
    """An all-gather step: the product of the block in hand (`held`, of a or b
    as `gathered` says) while `following`, the next block, is in transit
    (None: the last step, whose product takes every SM); with `barrier` the
    two pass through one optimization barrier, so that XLA's scheduler, which
    knows no custom call's time, does not end the transfer first. Returns the
    product and the next block."""
    step = beside_transfer if following is not None else product
    operands = (held, b) if gathered == "a" else (a, held)
    result = call(*operands, step, product.out_dtype)
    if barrier and following is not None:
        following, result = lax.optimization_barrier((following, result))
    return result, following


def _blocks(a, b, dims, factor, n):
    """The factor's length and the length of each device's block of it."""
    (_, am, _), (_, _, bn) = dims
    batch = _canonical.batch(a.shape[0], b.shape[0])
    size = {"batch": batch, "m": a.shape[am], "n": b.shape[bn]}[factor]
    return size, -(-size // n)


def _padded_slicers(a, b, dims, factor, padded, stack_rows=None):
    """a and b padded to `padded` along the factor's dimension, where they
    hold it, and their slicers (None for an operand without it: a for N, b
    for M, a broadcast batch), so that no slice is clamped. A slicer gives
    `_call`'s operands: where every slice is `stack_rows` long at a multiple
    of it and contiguous (`_as_stack`), a stack and the slice's index, else
    the slice."""
    (_, am, _), (_, _, bn) = dims
    batch = _canonical.batch(a.shape[0], b.shape[0])
    a_dim = {"batch": 0, "m": am, "n": None}[factor]
    b_dim = {"batch": 0, "m": None, "n": bn}[factor]

    def sliced(x, dim):
        if dim is None or (dim == 0 and x.shape[0] == 1 and batch != 1):
            return x, None
        x = _pad_to(x, dim, padded)
        stack = _as_stack(x, dim, stack_rows) if stack_rows else None
        if stack is not None:  # every slice asked for is one of the stack's (size stack_rows)
            return x, lambda start, size: (stack, jnp.asarray(start // stack_rows, jnp.int32))
        return x, lambda start, size: (lax.dynamic_slice_in_dim(x, start, size, axis=dim), None)

    (a, take_a), (b, take_b) = sliced(a, a_dim), sliced(b, b_dim)
    return a, b, take_a, take_b


def _assemble(results, *, n, block, size, factor, gather):
    """The ring's result from its pieces (along the factor's result
    dimension): this device's block, or with `gather`, every device's pieces
    ((n, B, M, N) each, block-major) side by side, each block cut to its rows."""
    dim = RESULT_DIM[factor]
    if not gather:
        return lax.slice_in_dim(jnp.concatenate(results, axis=dim), 0, block, axis=dim)
    stacked = lax.slice_in_dim(jnp.concatenate(results, axis=dim + 1), 0, block, axis=dim + 1)
    stacked = jnp.moveaxis(stacked, 0, dim)
    shape = list(stacked.shape)
    merged = shape[:dim] + [n * block] + shape[dim + 2 :]
    return lax.slice_in_dim(stacked.reshape(merged), 0, size, axis=dim)


def _gather_blocks(x, axes, n, index, forward):
    """(n, *x.shape): the x of every device of `axes`, in device order."""
    out = lax.dynamic_update_index_in_dim(jnp.zeros((n, *x.shape), x.dtype), x, index, 0)
    for s in range(1, n):
        x = lax.ppermute(x, axes, forward)  # device i - s's block
        out = lax.dynamic_update_index_in_dim(out, x, (index - s) % n, 0)
    return out


def all_gather_ring(
    call, product, a, b, *, axes, n, gathered, dims, size, beside_transfer, barrier=True
):
    """`call` on the full `gathered` operand ("a": along M, "b": along N), of
    which each device of `axes` holds one block, against the other operand's
    local block: the ring passes the blocks to device i - 1 and each step's
    product computes the result rows (or columns) of the block it holds, while
    the next block is in transit; the blocks are put in order at the end.
    `size` is the gathered dimension's full length (the blocks may be padded
    past it). Every product but the last runs beside a transfer and is
    described by `beside_transfer`.

    With `barrier`, the block in transit and the product beside it pass
    through one `lax.optimization_barrier`, so that the transfer's end and the
    product become ready together: XLA's default scheduler, which knows no
    custom call's time, otherwise ended the transfer before the product, and
    with the barrier it runs the product inside it (docs/sharding.md, "The
    all-gather ring's order"). The barrier holds no computation of its own.
    """
    (_, am, _), (_, _, bn) = dims
    moving = a if gathered == "a" else b
    out_dim = 1 if gathered == "a" else 2
    block = moving.shape[am if gathered == "a" else bn]
    backward = [(j, (j - 1) % n) for j in range(n)]
    index = lax.axis_index(axes)
    results = []
    for s in range(n):
        # The transfer of the next block depends only on this one: issued first,
        # it runs while this step's product does.
        following = lax.ppermute(moving, axes, backward) if s < n - 1 else None
        result, following = _beside(
            call, product, a, b, moving, gathered, following, beside_transfer, barrier
        )
        results.append(result)
        moving = following
    # Step s computed block (index + s) mod n, so block j is step (j - index)
    # mod n's: one gather writes the result once, where a zero-filled buffer
    # updated a block a step took two passes over it and a copy.
    order = (jnp.arange(n) - index) % n
    blocks = jnp.moveaxis(jnp.take(jnp.stack(results), order, axis=0), 0, out_dim)
    shape = list(results[0].shape)
    shape[out_dim] = n * block
    return lax.slice_in_dim(blocks.reshape(shape), 0, size, axis=out_dim)
