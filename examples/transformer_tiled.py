"""A transformer block (Flax NNX) trained with every product routed through
`jax_tiled.tiled`: the model is written with stock Flax layers and is not
edited; `jax_tiled.tiled(loss)` runs its projections, attention scores and
values, MLP and tied output embedding on jax_tiled's kernels, in the forward
and the backward pass. The same training runs on the stock layers next to it.

The task: predict the previous token of a random sequence, which one layer of
causal attention learns in a few hundred steps.

    python examples/transformer_tiled.py --steps 300

Prints both runs' losses, and a JSON summary as the last line.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_tiled


class Block(nnx.Module):
    def __init__(self, vocab: int, length: int, width: int, heads: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.position = nnx.Param(0.1 * jax.random.normal(rngs.params(), (length, width)))
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=heads, in_features=width, decode=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)
        self.norm3 = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.position[...]
        x = x + self.attention(self.norm1(x), mask=nnx.make_causal_mask(tokens))
        x = x + self.down(nnx.gelu(self.up(self.norm2(x))))
        return self.embed.attend(self.norm3(x))  # logits through the tied embedding


def batches(seed: int, vocab: int, length: int, batch_size: int):
    rng = np.random.default_rng(seed)
    while True:
        tokens = rng.integers(0, vocab, (batch_size, length)).astype(np.int32)
        yield tokens, np.roll(tokens, 1, axis=1)  # target: the previous token


def float_dots(jaxpr) -> int:
    """Floating-point dot_general equations left in a jaxpr, sub-jaxprs included."""
    from jax._src import core

    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "dot_general" and jnp.issubdtype(
            eqn.outvars[0].aval.dtype, jnp.floating
        )
        n += sum(float_dots(sub) for sub in core.jaxprs_in_params(eqn.params))
    return n


def train(route: bool, args) -> dict:
    model = Block(args.vocab, args.length, args.width, args.heads, nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params, tokens, targets):
        logits = nnx.merge(graphdef, params)(tokens)[:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets[:, 1:]).mean()

    if route:
        loss = jax_tiled.tiled(loss)  # the one change
    optimizer = optax.adam(3e-3)

    def step(params, opt_state, tokens, targets):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    data = batches(args.seed, args.vocab, args.length, args.batch_size)
    tokens, targets = next(data)
    opt_state = optimizer.init(params)
    jaxpr = jax.make_jaxpr(step)(params, opt_state, tokens, targets).jaxpr
    step = jax.jit(step)
    losses = []
    start = time.perf_counter()
    for _ in range(args.steps):
        params, opt_state, value = step(params, opt_state, *next(data))
        losses.append(float(value))
    tokens, targets = next(data)
    logits = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)
    accuracy = float(jnp.mean(jnp.argmax(logits, -1)[:, 1:] == targets[:, 1:]))
    return {
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "accuracy": accuracy,
        "seconds": time.perf_counter() - start,
        "float_dot_generals_in_step": float_dots(jaxpr),
        "tiled_matmuls_in_step": str(jaxpr).count("tiled_matmul["),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--length", type=int, default=12)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    routed, stock = train(True, args), train(False, args)
    for name, run in (("jax_tiled.tiled", routed), ("stock", stock)):
        print(
            f"{name:16s} loss {run['first_loss']:.3f} -> {run['final_loss']:.3f}, "
            f"accuracy {run['accuracy']:.3f}; products in the step: "
            f"{run['tiled_matmuls_in_step']} on tiled_matmul, "
            f"{run['float_dot_generals_in_step']} dot_general"
        )
    print(json.dumps({"steps": args.steps, "tiled": routed, "stock": stock}))


if __name__ == "__main__":
    main()
