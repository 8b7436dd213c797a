"""A jitted loop whose body XLA captures into a CUDA graph (command buffer).

Run by tests/test_cuda_graphs.py in a subprocess whose XLA_FLAGS force command
buffers on for fusions and custom calls and dump XLA's thunk sequence
(--xla_dump_to). Prints the loop's error against float64 NumPy; the test reads
the dump to check that our custom call sits inside a command buffer, which
needs the command-buffer trait.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jax_tiled

rng = np.random.default_rng(0)
a = rng.standard_normal((96, 80)).astype(np.float32)
w = (rng.standard_normal((80, 80)) / 9).astype(np.float32)


@jax.jit
def loop(a, w):
    body = lambda i, x: jnp.tanh(jax_tiled.matmul(x, w, precision="highest")) * 1.5 + 0.1
    return jax.lax.fori_loop(0, 4, body, a)


x = a.astype(np.float64)
for _ in range(4):
    x = np.tanh(x @ w) * 1.5 + 0.1
print("max error", float(np.abs(np.asarray(loop(a, w)) - x).max()))
