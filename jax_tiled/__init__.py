"""jax_tiled: hand-written tiled matrix-multiply kernels (CUDA and CPU) as a JAX primitive.

import jax_tiled
c = jax_tiled.matmul(a, b)                    # jnp.matmul semantics, this package's kernels
y = jax_tiled.dot_general(x, w, (((1,), (0,)), ((), ())))   # lax.dot_general semantics
f = jax_tiled.tiled(model_fn)                 # every float product inside on the kernels
jax.checkpoint(f, policy=jax_tiled.checkpoint_policies.dots_saveable)
jax_tiled.kernels()                           # kernels usable on the default backend
jax_tiled.explain(a, b)                       # which kernel "auto" runs for them, and why
jax_tiled.explain(a, b).kernel                # ... as fields: kernel, reason, plan, problem
"""

import importlib.util as _util

# The source tree's jax_tiled/ holds no compiled modules: fail here, before
# anything imports jax, and say how to get the installed package.
if _util.find_spec("jax_tiled._cpu") is None:
    raise ImportError(
        f"jax_tiled is being imported from a source tree ({__path__[0]}) that has no compiled "
        "modules. Install the package with `pip install .`, then import the installed one: "
        "run Python outside the repository root, or with `python -P` (PYTHONSAFEPATH=1), "
        "which keeps the current directory off sys.path."
    )

from jax_tiled import (
    _lowering,  # noqa: F401  (registers the primitive's lowering rules)
    checkpoint_policies,
)
from jax_tiled._dot_general import dot_general, einsum
from jax_tiled._explain import Explanation, explain, kernels
from jax_tiled._export import export_disabled_checks
from jax_tiled._matmul import matmul
from jax_tiled._primitive import tiled_matmul_p
from jax_tiled._tiled import tiled

__all__ = [
    "Explanation",
    "checkpoint_policies",
    "dot_general",
    "einsum",
    "explain",
    "export_disabled_checks",
    "kernels",
    "matmul",
    "tiled",
    "tiled_matmul_p",
]
__version__ = "0.1.0"
