"""`jax_tiled.tiled(fn)`: `fn` with its floating-point products on `tiled_matmul`.

Every `dot_general` that `@`, `jnp.matmul`, `jnp.einsum`, `jnp.dot`, Flax
layers or attention emit shows up in `fn`'s jaxpr. So a call traces `fn` to a
jaxpr for its arguments' types and evaluates that jaxpr again, one equation at
a time, on the arguments themselves, binding each primitive as `fn` did except
that a floating-point `dot_general` becomes `jax_tiled.dot_general`. Being a
re-evaluation on the caller's values (which may be tracers of `jit`, `grad`,
`vmap` or `checkpoint`), it composes with every transformation on the outside
and runs under `jit` at trace time only.

Products inside higher-order primitives are reached through the jaxprs those
carry: `jit`, `scan`, `while_loop`, `cond`, `checkpoint`/`remat` (whose dot
policies from `jax.checkpoint_policies` become `jax_tiled.checkpoint_policies`'),
`custom_jvp` and `custom_vjp` functions (and their derivative rules), and
`shard_map`. A product inside a higher-order primitive it does not know raises
NotImplementedError rather than run silently elsewhere.

A `transpose` feeding a product is folded into the product's dimension numbers
(computed only if something else needs it), so `x @ w.T` reads `w` as stored.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.extend import linear_util as lu
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
from jax.extend.core.primitives import dot_general_p, transpose_p

from jax_tiled import _compat, checkpoint_policies
from jax_tiled._canonical import SUPPORTED_DTYPES
from jax_tiled._dot_general import dot_general

F = TypeVar("F", bound=Callable[..., Any])


def tiled(fn: F) -> F:
    """`fn` with every floating-point `dot_general` inside it run by `tiled_matmul`.

    Products of float16, bfloat16, float32 or float64 operands (from `@`,
    `jnp.matmul`, `jnp.einsum`, `jnp.dot`, `lax.dot_general`, Flax layers,
    attention, and the backward pass of a `jax.grad` taken inside `fn`) run on
    this package's kernels, with the same dimension numbers, precision and
    output dtype; integer and other products are left as they are. The result
    composes with `jax.jit`, `jax.grad`, `jax.vmap` and `jax.checkpoint`.

    `fn` must be traceable, as for `jax.jit`: array arguments (and arrays
    inside pytree arguments) are traced, every other argument is passed as it
    is. `fn` should not mutate state it keeps outside its arguments and result
    (a Flax NNX module whose call updates batch statistics or RNG counts:
    route a function of `nnx.split`'s state instead, see docs/usage.md); as with
    `jax.jit`, pytree arguments are copies whose updates are lost.
    Outside `jit` each call traces `fn` again; wrap it in `jax.jit` for speed.
    """

    @functools.wraps(fn)
    def routed(*args, **kwargs):
        return _call(fn, args, kwargs)

    return routed  # type: ignore[return-value]


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _call(fn, args, kwargs):
    """fn(*args, **kwargs) with its products routed: arrays traced, the rest static,
    and results that are not arrays (None, Python numbers, symbolic zeros)
    handed back as `fn` returned them."""
    leaves, in_tree = jax.tree.flatten((args, kwargs))
    dynamic = [_is_array(x) for x in leaves]
    out_info = {}

    def flat_fn(*values):
        values = iter(values)
        args, kwargs = jax.tree.unflatten(
            in_tree, [next(values) if d else x for x, d in zip(leaves, dynamic)]
        )
        out = fn(*args, **kwargs)
        out_leaves, out_info["tree"] = jax.tree.flatten(out)
        out_info["leaves"] = out_leaves
        return [x for x in out_leaves if _is_array(x)]

    closed = jax.make_jaxpr(flat_fn)(*[x for x, d in zip(leaves, dynamic) if d])
    routed = iter(_eval(closed.jaxpr, closed.consts, [x for x, d in zip(leaves, dynamic) if d]))
    out = [next(routed) if _is_array(x) else x for x in out_info["leaves"]]
    return jax.tree.unflatten(out_info["tree"], out)


# ---- Which equations change ----


def _routed_dot(eqn) -> bool:
    if eqn.primitive is not dot_general_p:
        return False
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
    return all(np.dtype(a.dtype) in SUPPORTED_DTYPES for a in avals)


def _has_routed_dot(jaxpr: Jaxpr, seen=None) -> bool:
    seen = {} if seen is None else seen
    key = id(jaxpr)
    if key not in seen:
        seen[key] = False  # cycles do not occur, but a jaxpr may be shared
        seen[key] = any(
            _routed_dot(eqn)
            or _custom_rule(eqn)
            or any(_has_routed_dot(sub, seen) for sub in _compat.jaxprs_in_params(eqn.params))
            for eqn in jaxpr.eqns
        )
    return seen[key]


def _custom_rule(eqn) -> bool:
    """custom_jvp/custom_vjp: their derivative rules are not jaxprs until used,
    so they are routed whether or not they hold products."""
    return any(k in eqn.params for k in ("jvp_jaxpr_fun", "jvp_jaxpr_thunk", "fwd_jaxpr_thunk"))


# ---- Evaluation ----


@dataclasses.dataclass
class _Transposed:
    """The output of a `transpose` equation, computed only when read as a value."""

    operand: Any
    permutation: tuple[int, ...]
    value: Any = None

    def get(self):
        if self.value is None:
            self.value = jax.lax.transpose(self.operand, self.permutation)
        return self.value


def _eval(jaxpr: Jaxpr, consts, args) -> list:
    env: dict = {}

    def read_raw(v):
        return v.val if isinstance(v, Literal) else env[v]

    def read(v):
        x = read_raw(v)
        return x.get() if isinstance(x, _Transposed) else x

    def write(v, x):
        if not isinstance(v, _compat.DropVar):
            env[v] = x

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        write(v, x)
    for v, x in zip(jaxpr.invars, args, strict=True):
        write(v, x)
    for eqn in jaxpr.eqns:
        with _context(eqn):
            if eqn.primitive is transpose_p:
                out = _Transposed(read(eqn.invars[0]), tuple(eqn.params["permutation"]))
            elif _routed_dot(eqn):
                out = _dot(eqn, *map(read_raw, eqn.invars))
            else:
                out = _bind(eqn, list(map(read, eqn.invars)))
        if eqn.primitive.multiple_results:
            for v, x in zip(eqn.outvars, out, strict=True):
                write(v, x)
        else:
            write(eqn.outvars[0], out)
    return list(map(read, jaxpr.outvars))


def _context(eqn):
    """The equation's source location and context (as jax's own eval_jaxpr keeps them)."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    user_context = source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    if ctx is None:
        return user_context
    return _both(user_context, ctx)


class _both:
    def __init__(self, *managers):
        self.managers = managers

    def __enter__(self):
        for m in self.managers:
            m.__enter__()

    def __exit__(self, *exc):
        for m in reversed(self.managers):
            m.__exit__(*exc)


def _dot(eqn, lhs, rhs):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, lc, lb = _fold_transpose(lhs, lc, lb, eqn.invars[0].aval.ndim)
    rhs, rc, rb = _fold_transpose(rhs, rc, rb, eqn.invars[1].aval.ndim)
    out = dot_general(
        lhs,
        rhs,
        ((lc, rc), (lb, rb)),
        precision=eqn.params.get("precision"),
        preferred_element_type=eqn.params.get("preferred_element_type"),
        out_sharding=eqn.params.get("out_sharding"),
    )
    want = eqn.outvars[0].aval
    got = jax.typeof(out)
    if got.dtype != want.dtype or got.weak_type != want.weak_type:
        # dot_general's result is weak where both operands are; a jaxpr around it
        # (a scan's carry, say) may depend on that.
        out = _compat.convert_keeping_weak_type(out, want.dtype, want.weak_type)
    return out


def _fold_transpose(x, contract, batch, ndim):
    """A transposed operand as its source, with the dimension numbers mapped
    through the permutation, where that keeps the free dimensions' order (the
    result's); else the transposed value."""
    if not isinstance(x, _Transposed):
        return x, tuple(contract), tuple(batch)
    perm = x.permutation
    free = [d for d in range(ndim) if d not in (*contract, *batch)]
    if [perm[d] for d in free] != sorted(perm[d] for d in free):
        return x.get(), tuple(contract), tuple(batch)
    return x.operand, tuple(perm[d] for d in contract), tuple(perm[d] for d in batch)


def _bind(eqn, invals):
    params = eqn.params
    if any(True for _ in _compat.jaxprs_in_params(params)) and (
        _custom_rule(eqn) or any(_has_routed_dot(j) for j in _compat.jaxprs_in_params(params))
    ):
        special = _HIGHER_ORDER.get(eqn.primitive.name)
        if special is not None:
            return special(eqn, invals)
        params = _rewrite_params(eqn)
    return _compat.bind_with_params(eqn.primitive, invals, params)


# ---- Rewriting the jaxprs that higher-order primitives carry ----


def _rewrite_closed(closed: ClosedJaxpr) -> ClosedJaxpr:
    if not _has_routed_dot(closed.jaxpr):
        return closed
    return jax.make_jaxpr(lambda *args: _eval(closed.jaxpr, closed.consts, args))(*closed.in_avals)


def _rewrite_open(jaxpr: Jaxpr, primitive: str) -> Jaxpr:
    if not _has_routed_dot(jaxpr):
        return jaxpr
    closed = _rewrite_closed(ClosedJaxpr(jaxpr, ()))
    if closed.consts:
        raise NotImplementedError(
            f"jax_tiled.tiled: the body of {primitive} captures {len(closed.consts)} array "
            "constant(s); pass them as arguments to route its products onto tiled_matmul"
        )
    return closed.jaxpr


def _rewrite_params(eqn) -> dict:
    def rewrite(v):
        if isinstance(v, ClosedJaxpr):
            return _rewrite_closed(v)
        if isinstance(v, Jaxpr):
            return _rewrite_open(v, eqn.primitive.name)
        if isinstance(v, tuple) and any(isinstance(x, (Jaxpr, ClosedJaxpr)) for x in v):
            items = map(rewrite, v)
            # custom_linear_solve keeps its jaxprs in a namedtuple.
            return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
        return v

    return {k: rewrite(v) for k, v in eqn.params.items()}


def _remat(eqn, invals):
    params = _rewrite_params(eqn)
    policy = params.get("policy")
    params["policy"] = checkpoint_policies._JAX_EQUIVALENTS.get(id(policy), policy)
    return _compat.bind_with_params(eqn.primitive, invals, params)


def _wrapped(fun: lu.WrappedFun, f: Callable) -> lu.WrappedFun:
    return lu.wrap_init(f, debug_info=fun.debug_info)


def _custom_jvp_call(eqn, invals):
    params = _rewrite_params(eqn)
    key = next(k for k in ("jvp_jaxpr_fun", "jvp_jaxpr_thunk") if k in params)
    rule = params[key]

    @functools.cache
    def jvp_jaxpr(*zeros):
        jaxpr, consts, *rest = _call_fun(rule, zeros)
        routed = _rewrite_closed(ClosedJaxpr(jaxpr, consts))
        return (routed.jaxpr, routed.consts, *rest)

    params[key] = _wrapped(rule, jvp_jaxpr) if isinstance(rule, lu.WrappedFun) else jvp_jaxpr
    return _compat.bind_with_params(eqn.primitive, invals, params)


def _custom_vjp_call(eqn, invals):
    params = _rewrite_params(eqn)
    fwd, bwd = params["fwd_jaxpr_thunk"], params["bwd"]

    def fwd_jaxpr(*nonzeros):
        jaxpr, consts, *rest = _call_fun(fwd, nonzeros)
        routed = _rewrite_closed(ClosedJaxpr(jaxpr, consts))
        return (routed.jaxpr, routed.consts, *rest)

    def routed_bwd(*args):
        return _call(lambda *a: _call_fun(bwd, a), args, {})

    params["fwd_jaxpr_thunk"] = (
        _wrapped(fwd, fwd_jaxpr) if isinstance(fwd, lu.WrappedFun) else fwd_jaxpr
    )
    params["bwd"] = _wrapped(bwd, routed_bwd) if isinstance(bwd, lu.WrappedFun) else routed_bwd
    return _compat.bind_with_params(eqn.primitive, invals, params)


def _call_fun(fun, args):
    return fun.call_wrapped(*args) if isinstance(fun, lu.WrappedFun) else fun(*args)


def _shard_map(eqn, invals):
    """Re-expressed through the public `jax.shard_map`, which sets up the manual
    axes that tracing the body needs."""
    p = eqn.params
    missing = {"mesh", "in_specs", "out_specs", "jaxpr", "check_vma"} - set(p)
    if missing:
        raise NotImplementedError(
            f"jax_tiled.tiled: cannot route products inside this jax's shard_map (its "
            f"parameters lack {sorted(missing)})"
        )
    body = p["jaxpr"]
    axes = p.get("newly_manual_axes", p.get("manual_axes"))
    kwargs = {} if axes is None else {"axis_names": set(axes)}
    f = jax.shard_map(
        lambda *args: tuple(_eval(body, (), args)),
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        check_vma=p["check_vma"],
        **kwargs,
    )
    return f(*invals)


_HIGHER_ORDER = {
    "remat2": _remat,
    "checkpoint": _remat,
    "remat": _remat,
    "custom_jvp_call": _custom_jvp_call,
    "custom_vjp_call": _custom_vjp_call,
    "custom_vjp_call_jaxpr": _custom_vjp_call,
    "shard_map": _shard_map,
}
