"""Checkpoint policies that know `tiled_matmul` is a dot.

`jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable)` saves the
outputs of `dot_general` (and convolutions) and recomputes the rest; it does not
know this package's primitive, so under it a model built on `jax_tiled` saves no
product and runs every forward product again in the backward pass. The
policies here have the same names and meanings and treat `tiled_matmul` as a
dot:

    jax.checkpoint(f, policy=jax_tiled.checkpoint_policies.dots_saveable)

Any other policy, composite (`save_from_both_policies(...)`) or written by
hand, learns the same through `knowing_tiled_matmul(policy)`, which shows it
each `tiled_matmul` as the `dot_general` it computes. `jax_tiled.tiled` applies
it to the policy of every `jax.checkpoint` inside the function it routes.

"No batch dimensions" means, for `tiled_matmul`, a product whose canonical
batch is 1 on both operands: a layer's `x @ w` (any leading dimensions of `x`
fold into its rows), not a batched product such as attention's scores.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.extend.core.primitives import dot_general_p

from jax_tiled._primitive import tiled_matmul_p

__all__ = [
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
    "offload_dot_with_no_batch_dims",
    "knowing_tiled_matmul",
]

Policy = Callable[..., Any]

# policy -> the same policy knowing tiled_matmul, so that a policy converted
# again is the same function (a checkpoint's parameters are part of the jaxpr
# that jit caches compilations by).
_KNOWING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def knowing_tiled_matmul(policy: Policy | None) -> Policy | None:
    """`policy`, asked about each `tiled_matmul` as about the `dot_general` it
    computes: operands (M, K) and (K, N) (stored transposed where the
    primitive's flags say so) with no batch dimensions where both canonical
    batches are 1, else (B, M, K) and (B, K, N) with batch dimension 0; the
    same precision and output dtype. Everything else goes to `policy` as it is.
    None (no policy) stays None."""
    if policy is None or getattr(policy, "_knows_tiled_matmul", False):
        return policy
    try:
        return _KNOWING[policy]
    except (KeyError, TypeError):  # TypeError: not weakly referenceable
        pass

    @functools.wraps(policy)
    def knowing(prim, *avals, **params):
        if prim is tiled_matmul_p:
            lhs, rhs, dot_params = _as_dot_general(*avals, **params)
            return policy(dot_general_p, lhs, rhs, **dot_params)
        return policy(prim, *avals, **params)

    knowing._knows_tiled_matmul = True
    try:
        _KNOWING[policy] = knowing
    except TypeError:
        pass
    return knowing


def _as_dot_general(a, b, *, transpose_a, transpose_b, out_dtype, precision, kernel):
    """(lhs aval, rhs aval, dot_general's params) of a `tiled_matmul`."""
    del kernel
    lhs_k, rhs_k = (2 if transpose_a else 1), (1 if transpose_b else 2)
    if a.shape[0] == 1 and b.shape[0] == 1:
        lhs, rhs = a.update(shape=a.shape[1:]), b.update(shape=b.shape[1:])
        dims = (((lhs_k - 1,), (rhs_k - 1,)), ((), ()))
    else:
        batch = b.shape[0] if a.shape[0] == 1 else a.shape[0]
        lhs, rhs = a.update(shape=(batch, *a.shape[1:])), b.update(shape=(batch, *b.shape[1:]))
        dims = (((lhs_k,), (rhs_k,)), ((0,), (0,)))
    if isinstance(precision, lax.Precision):
        precision = (precision, precision)
    params = dict(
        dimension_numbers=dims,
        precision=precision,
        preferred_element_type=out_dtype,
        out_sharding=None,
    )
    return lhs, rhs, params


_jax = jax.checkpoint_policies

dots_saveable = knowing_tiled_matmul(_jax.dots_saveable)
dots_saveable.__doc__ = (
    "Save the result of every product (`tiled_matmul`, `dot_general`) and convolution."
)
checkpoint_dots = dots_saveable

dots_with_no_batch_dims_saveable = knowing_tiled_matmul(_jax.dots_with_no_batch_dims_saveable)
dots_with_no_batch_dims_saveable.__doc__ = """Save the result of every product without batch
dimensions; a transformer's projections and MLP, not its attention scores."""
checkpoint_dots_with_no_batch_dims = dots_with_no_batch_dims_saveable


def offload_dot_with_no_batch_dims(offload_src: str, offload_dst: str) -> Policy:
    """As `dots_with_no_batch_dims_saveable`, but those results move from memory
    kind `offload_src` to `offload_dst` (e.g. "device" to "pinned_host")
    instead of staying where they are."""
    return knowing_tiled_matmul(_jax.offload_dot_with_no_batch_dims(offload_src, offload_dst))
