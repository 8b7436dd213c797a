"""Export a function that runs on jax_tiled with a symbolic batch size,
serialize it, and load and call it in a fresh process.

A small softmax regression is trained for `--steps` steps (its products on
jax_tiled's kernels), then its `predict` is exported for any batch size with
`jax.export`, written to a file, and a new Python process (which imports
jax_tiled, as any process calling the exported module must) loads and calls it
on two batch sizes; the answers must equal this process's.

    python examples/export_roundtrip.py --steps 100

Prints what happened, and a JSON summary as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

import jax_tiled

LOADER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from jax import export
    import jax_tiled  # registers the FFI targets that the exported module calls

    exported = export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
    inputs = np.load(sys.argv[2])
    print(json.dumps({name: np.asarray(exported.call(inputs[name])).tolist()
                      for name in inputs.files}))
""")


def predict(w, b, x):
    return jax.nn.softmax(jax_tiled.matmul(x, w) + b)


def train(steps: int, seed: int):
    rng = np.random.default_rng(seed)
    true_w = rng.standard_normal((8, 3)).astype(np.float32)
    w, b = jnp.zeros((8, 3)), jnp.zeros((3,))

    def loss(w, b, x, y):
        return -jnp.mean(jnp.sum(jax.nn.one_hot(y, 3) * jnp.log(predict(w, b, x) + 1e-9), -1))

    step = jax.jit(
        lambda w, b, x, y: jax.tree.map(
            lambda p, g: p - 0.5 * g, (w, b), jax.grad(loss, (0, 1))(w, b, x, y)
        )
    )
    x = rng.standard_normal((256, 8)).astype(np.float32)
    y = np.argmax(x @ true_w, -1)
    first = float(loss(w, b, x, y))
    for _ in range(steps):
        w, b = step(w, b, x, y)
    return w, b, first, float(loss(w, b, x, y))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    w, b, first, final = train(args.steps, args.seed)

    (batch,) = export.symbolic_shape("batch")
    exported = export.export(
        jax.jit(lambda x: predict(w, b, x)),
        disabled_checks=jax_tiled.export_disabled_checks(),  # the kernels' FFI calls
    )(jax.ShapeDtypeStruct((batch, 8), jnp.float32))
    print(
        f"trained {args.steps} steps (loss {first:.3f} -> {final:.3f}); exported for "
        f"input {exported.in_avals[0].str_short()} -> {exported.out_avals[0].str_short()}"
    )

    rng = np.random.default_rng(args.seed + 1)
    inputs = {
        "batch of 5": rng.standard_normal((5, 8)).astype(np.float32),
        "batch of 64": rng.standard_normal((64, 8)).astype(np.float32),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "predict.jax")
        with open(model, "wb") as f:
            f.write(exported.serialize())
        np.savez(os.path.join(tmp, "inputs.npz"), **inputs)
        with open(os.path.join(tmp, "load.py"), "w") as f:
            f.write(LOADER)
        loaded = subprocess.run(
            [sys.executable, "load.py", model, "inputs.npz"],
            cwd=tmp,
            capture_output=True,
            text=True,
            check=True,
        )
    answers = json.loads(loaded.stdout.strip().splitlines()[-1])
    worst = 0.0
    for name, x in inputs.items():
        here = np.asarray(predict(w, b, x))
        there = np.asarray(answers[name], np.float32)
        assert there.shape == here.shape, (there.shape, here.shape)
        worst = max(worst, float(np.abs(there - here).max()))
        print(
            f"{name}: loaded in a new process, called, shape {there.shape}, "
            f"max difference from this process {np.abs(there - here).max():.2g}"
        )
    print(
        json.dumps(
            {
                "steps": args.steps,
                "first_loss": first,
                "final_loss": final,
                "batches": [len(x) for x in inputs.values()],
                "max_difference": worst,
            }
        )
    )


if __name__ == "__main__":
    main()
