"""Everything that depends on jax's private modules or on the jax version, in one place.

Supported: jax/jaxlib >= 0.8.0. The rest of the package uses public APIs only
(`jax.ffi`, `jax.interpreters.mlir`, `jaxlib.mlir.ir`,
`jax.experimental.custom_partitioning`, `jax.sharding`); each entry below says
why it cannot, and which jax versions need it. When the oldest supported jax
gains a public equivalent, replace the entry and delete it here.
"""

from __future__ import annotations

from jax import lax

__all__ = ["cast_to_varying", "lower_with_sharding_in_types", "require_devices_during_lowering",
           "varying_axes"]

# Private, needed by every supported version (0.8.0 through 0.11 at least):
# jit hands the device assignment to lowering only when the jaxpr holds a
# primitive in this set. `custom_partitioning` needs it and is in the set, but
# our primitive calls it from inside its own lowering rule, where jit cannot
# see it. jax's own custom-partitioned primitives (cuDNN attention, scaled
# matmul) register the same way; there is no public hook.
from jax._src.dispatch import prim_requires_devices_during_lowering

# Private, needed by every supported version: wraps a lowered value in the
# sharding its abstract value carries under explicit mesh axes (a no-op on
# auto or fully manual meshes). `jax.interpreters.mlir` does not re-export it;
# jax's own lowering rules call it for the same purpose.
from jax._src.interpreters.mlir import lower_with_sharding_in_types


def require_devices_during_lowering(primitive) -> None:
    """Asks jit to pass the device assignment to `primitive`'s lowering rule."""
    prim_requires_devices_during_lowering.add(primitive)


def varying_axes(aval) -> frozenset:
    """The manual mesh axes a value varies over inside `shard_map`: `aval.vma`
    in jax 0.8 and 0.9, `aval.mat.varying` from jax 0.10."""
    mat = getattr(aval, "mat", None)
    return mat.varying if mat is not None else getattr(aval, "vma", frozenset())


def cast_to_varying(x, axes: tuple[str, ...]):
    """x cast to vary over the manual mesh axes `axes`: `lax.pcast(..., to="varying")`
    from jax 0.8.2; `lax.pvary` before it (deprecated in 0.8.2, removed in 0.10)."""
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)
