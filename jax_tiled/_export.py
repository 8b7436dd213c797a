"""What `jax.export` needs to serialize a function that uses this package."""

from __future__ import annotations

from jax import export

from jax_tiled import _ffi


def export_disabled_checks() -> list[export.DisabledSafetyCheck]:
    """The safety checks `jax.export.export` must skip for this package's calls.

    `jax.export` refuses custom calls whose targets JAX does not guarantee to
    keep stable; `tiled_matmul` lowers to one FFI call per platform. Pass these
    as `jax.export.export(jax.jit(f), disabled_checks=jax_tiled.export_disabled_checks())`.
    The process that deserializes and calls the result must `import jax_tiled`
    first (which registers the FFI targets), with a build of this package whose
    calls take the same operands and attributes.
    """
    return [export.DisabledSafetyCheck.custom_call(target) for target in _ffi.TARGETS.values()]
