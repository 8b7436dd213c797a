"""One eager call of a product, measured in a fresh process: `eager_call.py NAME N`.

Run by tests/test_eager.py. Prints one JSON line: how many XLA compilations
the first call of NAME on N x N float32 operands (4 x N/2 x N/2 for the
batched ones) makes, and the second; the peak resident memory of the second
call over what its inputs already hold (the peak is reset through
/proc/self/clear_refs after the first); and the output's size.

The process runs on two CPUs (CI's count): each of the CPU kernel's threads
keeps a scratch that grows to the largest tile it has packed, and on a
machine of 64 CPUs a call after the first could land tiles on threads that
had none yet, whose new scratch read as up to 5 MiB more peak from call to
call (16 test workers on 64 cores, 2026-11-27). Pinned, the count measures
what it is for: the copies an eager call must not make (+64 MiB here).
"""

import collections
import gc
import json
import os
import sys

# Before jax starts its thread pools, which size themselves to the CPUs allowed.
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_tiled  # noqa: E402

CALLS = {
    "jnp.matmul": jnp.matmul,
    "lax.dot_general": lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ()))),
    "matmul": jax_tiled.matmul,
    "dot_general": lambda a, b: jax_tiled.dot_general(a, b, (((1,), (1,)), ((), ()))),
    "batched matmul": jax_tiled.matmul,
    "batched jnp.matmul": jnp.matmul,
}
COMPILE = "/jax/core/compile/backend_compile_duration"


def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024


name, n = sys.argv[1], int(sys.argv[2])
f = CALLS[name]
shape = (4, n // 2, n // 2) if name.startswith("batched") else (n, n)

a = jax.random.normal(jax.random.key(0), shape, jnp.float32)
b = jax.random.normal(jax.random.key(1), shape, jnp.float32)
jax.block_until_ready((a, b))
events = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kwargs: events.update([event])
)

f(a, b).block_until_ready()
compiles = events[COMPILE]
gc.collect()
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")
base = status("VmRSS:")
c = f(a, b).block_until_ready()
peak = status("VmHWM:")
print(
    json.dumps(
        {
            "compiles": compiles,
            "recompiles": events[COMPILE] - compiles,
            "peak_mib": (peak - base) / 2**20,
            "out_mib": c.nbytes / 2**20,
        }
    )
)
