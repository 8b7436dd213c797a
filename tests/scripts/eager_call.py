"""One eager call of a product, measured in a fresh process: `eager_call.py NAME N`.

Run by tests/test_eager.py. Prints one JSON line: the peak resident memory of
one call of NAME on N x N float32 operands (4 x N/2 x N/2 for the batched
ones) over what its inputs already hold, after a warm-up call that compiles it
(the peak is reset through /proc/self/clear_refs); the median time of a small
(8 x 8) call; and the output's size.
"""

import gc
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jax_tiled

CALLS = {
    "jnp.matmul": jnp.matmul,
    "lax.dot_general": lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ()))),
    "matmul": jax_tiled.matmul,
    "dot_general": lambda a, b: jax_tiled.dot_general(a, b, (((1,), (1,)), ((), ()))),
    "batched matmul": jax_tiled.matmul,
    "batched jnp.matmul": jnp.matmul,
}


def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024


name, n = sys.argv[1], int(sys.argv[2])
f = CALLS[name]
shape = (4, n // 2, n // 2) if name.startswith("batched") else (n, n)

a = jax.random.normal(jax.random.key(0), shape, jnp.float32)
b = jax.random.normal(jax.random.key(1), shape, jnp.float32)
f(a, b).block_until_ready()
gc.collect()
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")
base = status("VmRSS:")
c = f(a, b).block_until_ready()
peak = status("VmHWM:")

x = y = jnp.ones((8, 8), jnp.float32)
f(x, y).block_until_ready()
times = []
for _ in range(7):
    t0 = time.perf_counter()
    for _ in range(50):
        f(x, y).block_until_ready()
    times.append((time.perf_counter() - t0) / 50)
print(json.dumps({"peak_mib": (peak - base) / 2**20, "call_us": statistics.median(times) * 1e6,
                  "out_mib": c.nbytes / 2**20}))
