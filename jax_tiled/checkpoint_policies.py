"""`jax.checkpoint_policies`' dot policies, knowing that `tiled_matmul` is a dot.

`jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable)` saves the
outputs of `dot_general` (and convolutions) and recomputes the rest; it does not
know this package's primitive, so under it a model built on `jax_tiled` saves no
product and runs every forward product again in the backward pass. The
policies here have the same names and meanings and treat `tiled_matmul` as a
dot; everything else they hand to jax's policy of the same name:

    jax.checkpoint(f, policy=jax_tiled.checkpoint_policies.dots_saveable)

"No batch dimensions" means, for `tiled_matmul`, a product whose canonical
batch is 1 on both operands: a layer's `x @ w` (any leading dimensions of `x`
fold into its rows), not a batched product such as attention's scores.
"""

from __future__ import annotations

from typing import Any

import jax

from jax_tiled import _compat
from jax_tiled._primitive import tiled_matmul_p

__all__ = [
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
    "offload_dot_with_no_batch_dims",
]

_jax = jax.checkpoint_policies


def _no_batch(a, b) -> bool:
    return a.shape[0] == 1 and b.shape[0] == 1


def dots_saveable(prim, *avals, **params) -> bool:
    """Save the result of every product (`tiled_matmul`, `dot_general`) and convolution."""
    return prim is tiled_matmul_p or _jax.dots_saveable(prim, *avals, **params)


checkpoint_dots = dots_saveable


def dots_with_no_batch_dims_saveable(prim, *avals, **params) -> bool:
    """Save the result of every product without batch dimensions; a transformer's
    projections and MLP, not its attention scores."""
    if prim is tiled_matmul_p:
        return _no_batch(*avals)
    return _jax.dots_with_no_batch_dims_saveable(prim, *avals, **params)


checkpoint_dots_with_no_batch_dims = dots_with_no_batch_dims_saveable


def offload_dot_with_no_batch_dims(offload_src: str, offload_dst: str):
    """As `dots_with_no_batch_dims_saveable`, but those results move from memory
    kind `offload_src` to `offload_dst` (e.g. "device" to "pinned_host")
    instead of staying where they are."""
    jax_policy = _jax.offload_dot_with_no_batch_dims(offload_src, offload_dst)

    def policy(prim, *avals, **params) -> Any:
        if prim is tiled_matmul_p:
            if _no_batch(*avals):
                return _compat.Offloadable(src=offload_src, dst=offload_dst)
            return _compat.Recompute
        return jax_policy(prim, *avals, **params)

    return policy


# jax's policy -> ours, for `jax_tiled.tiled` to translate the policies of the
# `jax.checkpoint`s inside a function it routes onto `tiled_matmul`.
_JAX_EQUIVALENTS = {
    id(_jax.dots_saveable): dots_saveable,
    id(_jax.checkpoint_dots): checkpoint_dots,
    id(_jax.dots_with_no_batch_dims_saveable): dots_with_no_batch_dims_saveable,
    id(_jax.checkpoint_dots_with_no_batch_dims): checkpoint_dots_with_no_batch_dims,
}
