"""Everything that depends on jax's private modules or on the jax version, in one place.

Supported: jax/jaxlib >= 0.8.0. The rest of the package uses public APIs only
(`jax.ffi`, `jax.interpreters.mlir`, `jaxlib.mlir.ir`, `jax.extend`, `jax.export`,
`jax.experimental.custom_partitioning`, `jax.sharding`); each entry below says
why it cannot, and which jax versions need it. When the oldest supported jax
gains a public equivalent, replace the entry and delete it here.
"""

from __future__ import annotations

import functools

import jax
from jax import lax

__all__ = [
    "DropVar",
    "Offloadable",
    "Recompute",
    "bind_with_params",
    "cast_to_varying",
    "convert_keeping_weak_type",
    "inline_jit",
    "lower_with_sharding_in_types",
    "require_devices_during_lowering",
    "trace_context",
    "varying_axes",
]

# Private, needed by every supported version (0.8.0 through 0.11 at least):
# jit hands the device assignment to lowering only when the jaxpr holds a
# primitive in this set. `custom_partitioning` needs it and is in the set, but
# our primitive calls it from inside its own lowering rule, where jit cannot
# see it. jax's own custom-partitioned primitives (cuDNN attention, scaled
# matmul) register the same way; there is no public hook.
# Private, needed by every supported version, for `jax_tiled.tiled`'s jaxpr
# interpreter (the rest of what it reads of a jaxpr is in `jax.extend`):
# - the equations' output variables that nothing reads (`jax.extend.core`
#   lacks them in jax 0.8);
# - a dtype conversion that sets the result's weak type, which the jaxpr being
#   re-evaluated may depend on (`lax.convert_element_type` makes strong types).
# Private, needed by every supported version: the class of traced values, to
# tell a call made while tracing from an eager one (inline_jit below).
# Private, needed by every supported version: the configuration a trace depends
# on (x64, the default matmul precision, ...), which jit's own caches key on;
# `jax_tiled.tiled` keys its cache of traces and rewritten jaxprs on it too.
from jax._src.config import trace_context
from jax._src.core import DropVar, Tracer
from jax._src.dispatch import prim_requires_devices_during_lowering

# Private, needed by every supported version: wraps a lowered value in the
# sharding its abstract value carries under explicit mesh axes (a no-op on
# auto or fully manual meshes). `jax.interpreters.mlir` does not re-export it;
# jax's own lowering rules call it for the same purpose.
from jax._src.interpreters.mlir import lower_with_sharding_in_types

# Private, needed by every supported version: what a remat policy returns for a
# value to recompute or to move to another memory kind. jax's own policies
# return these; `jax.checkpoint_policies` does not export them.
from jax._src.interpreters.partial_eval import Offloadable, Recompute
from jax._src.lax.lax import _convert_element_type as convert_keeping_weak_type


def lowers_for_one_device(ctx) -> bool:
    """Whether a lowering rule's program runs on one device, unpartitioned: a
    `ShardingContext` of one device (a manual `shard_map` body has an
    `SPMDAxisContext`, which has no `num_devices`)."""
    return getattr(ctx.module_context.axis_context, "num_devices", None) == 1


def require_devices_during_lowering(primitive) -> None:
    """Asks jit to pass the device assignment to `primitive`'s lowering rule."""
    prim_requires_devices_during_lowering.add(primitive)


def varying_axes(aval) -> frozenset:
    """The manual mesh axes a value varies over inside `shard_map`: `aval.vma`
    in jax 0.8 and 0.9, `aval.mat.varying` from jax 0.10."""
    mat = getattr(aval, "mat", None)
    return mat.varying if mat is not None else getattr(aval, "vma", frozenset())


def bind_with_params(primitive, invals, params):
    """`primitive` bound to `invals` with an equation's `params`: from jax 0.9
    `get_bind_params` returns the parameters; before it, (subfuns, params)."""
    bind_params = primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):
        subfuns, bind_params = bind_params
        return primitive.bind(*subfuns, *invals, **bind_params)
    return primitive.bind(*invals, **bind_params)


def cast_to_varying(x, axes: tuple[str, ...]):
    """x cast to vary over the manual mesh axes `axes`: `lax.pcast(..., to="varying")`
    from jax 0.8.2; `lax.pvary` before it (deprecated in 0.8.2, removed in 0.10)."""
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)


def inline_jit(*, static_argnames: tuple[str, ...]):
    """`jax.jit(fn, inline=True, static_argnames=...)`, inlined while tracing.

    Called eagerly, the compiled function; called while tracing, `fn` itself,
    so its operations join the caller's jaxpr with no call between them. jax
    up to 0.10 does this for inline=True; jax 0.11 keeps the call in the
    jaxpr and lowers its body as a separate MLIR function, where an operand's
    producer (a transpose the CPU lowering folds into the kernel's flag,
    `_lowering._stored_form`) is a function argument it cannot see.

    The operands are positional and the keyword arguments the static ones,
    so only the positional ones are searched for tracers on each call."""

    def wrap(fn):
        jitted = jax.jit(fn, inline=True, static_argnames=static_argnames)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if any(isinstance(x, Tracer) for x in jax.tree.leaves(args)):
                return fn(*args, **kwargs)
            return jitted(*args, **kwargs)

        return call

    return wrap
