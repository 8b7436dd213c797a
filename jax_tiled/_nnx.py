"""Flax NNX modules under `jax_tiled.tiled`: updated as `nnx.jit` updates them.

An NNX module is a mutable object. Passed through `jax.tree` as `tiled`
passes its arguments, it arrives as a copy, so the batch statistics and RNG
counts a call updates would be lost (dropout repeating its mask). As
`nnx.jit` does, `tiled` splits the graph nodes among the function and its
arguments into a graph definition and their state, routes a pure function of
that state which returns the state after the call, and writes that state back
into the caller's modules (shared modules stay shared).

Flax is imported only by a program that uses it: a graph node can exist only
where `flax.nnx` is already loaded.
"""

from __future__ import annotations

import dataclasses
import sys

import jax


def _graph():
    module = sys.modules.get("flax.nnx")
    return None if module is None else module.graph


def _is_node(x) -> bool:
    graph = _graph()
    return graph is not None and graph.is_graph_node(x)


def holds_graph_nodes(fn, args, kwargs) -> bool:
    if _graph() is None:
        return False
    return any(map(_is_node, jax.tree.leaves((fn, args, kwargs), is_leaf=_is_node)))


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where the i-th graph node sat among the function and its arguments."""

    index: int


def call(route, fn, args, kwargs):
    """fn(*args, **kwargs) through `route` (tiled's routed call, taking
    (fn, args, kwargs)), its graph nodes' state carried in and the parts of it
    that the call changed written back. Nothing changed, nothing is written:
    a module that only reads its variables may be called in any trace, as
    it could be without `tiled`."""
    from flax import nnx

    leaves, tree = jax.tree.flatten((fn, args, kwargs), is_leaf=_is_node)
    nodes = tuple(x for x in leaves if _is_node(x))
    slots = iter(range(len(nodes)))
    leaves = [_Slot(next(slots)) if _is_node(x) else x for x in leaves]
    graphdef, state = nnx.split(nodes)
    out, updates = route(_pure, (graphdef, state, tree, leaves), {})
    old, state_tree = jax.tree.flatten(state)
    if any(u is not _UNCHANGED for u in updates):
        new = [x if u is _UNCHANGED else u for x, u in zip(old, updates)]
        nnx.update(nodes, jax.tree.unflatten(state_tree, new))
    return out


class _Unchanged:
    """A state leaf the call left as it was (a static result of the trace)."""

    def __repr__(self):
        return "unchanged"


_UNCHANGED = _Unchanged()


def _pure(graphdef, state, tree, leaves):
    from flax import nnx

    nodes = nnx.merge(graphdef, state, copy=True)
    leaves = [nodes[x.index] if isinstance(x, _Slot) else x for x in leaves]
    fn, args, kwargs = jax.tree.unflatten(tree, leaves)
    out = fn(*args, **kwargs)
    before, after = jax.tree.leaves(state), jax.tree.leaves(nnx.state(nodes))
    updates = [_UNCHANGED if b is a else a for b, a in zip(before, after, strict=True)]
    return out, updates
