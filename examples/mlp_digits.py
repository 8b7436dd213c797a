"""A Flax NNX MLP on scikit-learn's digits, trained with optax, its layers'
products on jax_tiled's kernels (`dot_general=jax_tiled.dot_general`), next to
the same MLP on the stock layers from the same initial weights.

    python examples/mlp_digits.py --steps 300

Prints both test accuracies, and a JSON summary as the last line. The model
and its training step are the ones tests/test_flax.py trains on random data.
"""

from __future__ import annotations

import argparse
import json
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jax_tiled


class MLP(nnx.Module):
    """Two hidden layers; `dot_general=None` keeps the stock layers' products."""

    def __init__(
        self, dot_general, rngs: nnx.Rngs, inputs: int = 64, hidden: int = 128, classes: int = 10
    ):
        kw = {} if dot_general is None else {"dot_general": dot_general}
        self.l1 = nnx.Linear(inputs, hidden, rngs=rngs, **kw)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs, **kw)
        self.l3 = nnx.Linear(hidden, classes, rngs=rngs, **kw)

    def __call__(self, x):
        return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


@nnx.jit
def train_step(model, optimizer, x, y):
    """One optax step on the mean cross-entropy of (x, y); returns the loss."""

    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def data(seed: int):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return train_test_split(x, digits.target.astype(np.int32), test_size=0.25, random_state=seed)


def train(dot_general, steps: int, batch_size: int, seed: int) -> dict:
    x_train, x_test, y_train, y_test = data(seed)
    model = MLP(dot_general, nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def accuracy(model, x, y):
        return jnp.mean(jnp.argmax(model(x), -1) == y)

    order = np.random.default_rng(seed)
    start = time.perf_counter()
    for _ in range(steps):
        batch = order.choice(len(x_train), batch_size, replace=False)
        loss = train_step(model, optimizer, x_train[batch], y_train[batch])
    return {
        "loss": float(loss),
        "accuracy": float(accuracy(model, x_test, y_test)),
        "seconds": time.perf_counter() - start,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tiled = train(jax_tiled.dot_general, args.steps, args.batch_size, args.seed)
    stock = train(None, args.steps, args.batch_size, args.seed)
    print(
        f"jax_tiled layers: test accuracy {tiled['accuracy']:.4f}, final loss {tiled['loss']:.4f}"
    )
    print(
        f"stock layers:     test accuracy {stock['accuracy']:.4f}, final loss {stock['loss']:.4f}"
    )
    print(json.dumps({"steps": args.steps, "tiled": tiled, "stock": stock}))


if __name__ == "__main__":
    main()
