"""jax_tiled: hand-written tiled matrix-multiply kernels (CUDA and CPU) as a JAX primitive.

    import jax_tiled
    c = jax_tiled.matmul(a, b)        # jnp.matmul semantics, this package's kernels
    jax_tiled.kernels()               # kernels usable on the default backend
    jax_tiled.explain(a, b)           # which kernel "auto" runs for them, and why
"""

from jax_tiled._matmul import explain, kernels, matmul
from jax_tiled._primitive import tiled_matmul_p
from jax_tiled import _lowering  # noqa: F401  (registers the primitive's lowering rules)

__all__ = ["explain", "kernels", "matmul", "tiled_matmul_p"]
__version__ = "0.1.0"
