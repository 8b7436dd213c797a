"""`jax_tiled.tiled(fn)`: `fn` with its floating-point products on `tiled_matmul`.

Every `dot_general` that `@`, `jnp.matmul`, `jnp.einsum`, `jnp.dot`, Flax
layers or attention emit shows up in `fn`'s jaxpr. So a call traces `fn` to a
jaxpr for its arguments' types and evaluates that jaxpr again, one equation at
a time, on the arguments themselves, binding each primitive as `fn` did except
that a `dot_general` with a floating-point result becomes
`jax_tiled.dot_general` (`_checks.computed` says which). Being a
re-evaluation on the caller's values (which may be tracers of `jit`, `grad`,
`vmap` or `checkpoint`), it composes with every transformation on the outside.

Transformations applied from outside: differentiation rules (of `qr`, `eigh`,
`svd`, `triangular_solve`, ...) create products when they run, after the
rewrite. So under a transformation the re-evaluation is a `jax.custom_jvp`
function whose JVP is the routed re-evaluation of `jax.jvp` of the jaxpr: the
products a JVP rule creates are in that jaxpr and are routed too, and `grad`,
`vjp` and `linearize` transpose it (`tiled_matmul` transposes to itself).
`vmap` batches the re-evaluation equation by equation; the only rules that
create products while batching are `custom_vmap` functions' own, and those are
routed where the equation is re-bound.

Products inside higher-order primitives are reached through the jaxprs those
carry (closed, or open with constants that the primitive supplies): `jit`,
`scan`, `while_loop`, `cond`, `custom_linear_solve`, Equinox's primitives
(lineax's `linear_solve`) and any other primitive that carries jaxprs in its
parameters; `checkpoint`/`remat`, whose policy learns `tiled_matmul`
(`checkpoint_policies.knowing_tiled_matmul`); `custom_jvp`, `custom_vjp` and
`custom_vmap` functions, whose rules run routed; and `shard_map`. Pallas
kernels are left as they are: their bodies are compiled by Pallas, which lowers
its own products. A jaxpr that cannot be rewritten to the same signature
raises NotImplementedError naming its primitive.

A call is cached per argument signature (the traced jaxpr, and outside any
transformation one jitted function), so eager calls trace and compile once.

A `transpose` feeding a product is folded into the product's dimension numbers
(computed only if something else needs it), so `x @ w.T` reads `w` as stored.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.core import Tracer
from jax.custom_derivatives import SymbolicZero
from jax.extend import linear_util as lu
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, primal_dtype_to_tangent_dtype
from jax.extend.core.primitives import dot_general_p, transpose_p

from jax_tiled import _checks, _compat, _nnx, checkpoint_policies
from jax_tiled._dot_general import dot_general

F = TypeVar("F", bound=Callable[..., Any])


def tiled(fn: F) -> F:
    """`fn` with every floating-point `dot_general` inside it run by `tiled_matmul`.

    Products into a float16, bfloat16, float32 or float64 result (from `@`,
    `jnp.matmul`, `jnp.einsum`, `jnp.dot`, `lax.dot_general`, Flax layers,
    attention, and the backward pass of a `jax.grad` taken inside `fn`) run on
    this package's kernels, with the same dimension numbers, precision and
    output dtype; products into an integer result are left as they are. The result
    composes with `jax.jit`, `jax.grad`, `jax.vmap` and `jax.checkpoint`, and
    the products that `grad`, `jvp`, `vjp` and `vmap` of the result create
    run on the kernels as well (docs/usage.md says what a second
    transformation on top reaches).

    `fn` must be traceable, as for `jax.jit`: array arguments (and arrays
    inside pytree arguments) are traced, every other argument is passed as it
    is, and the trace is cached per argument signature (shapes, dtypes, the
    other arguments' values, jax's configuration), so `fn` should not depend on
    state it does not take as arguments. Flax NNX modules among `fn` and its
    arguments are updated as `nnx.jit` updates them (batch statistics, RNG
    counts); an update to any other argument, which `tiled` receives as a copy,
    raises ValueError rather than be lost.
    """
    traces = _Traces()

    @functools.wraps(fn)
    def routed(*args, **kwargs):
        return _call(fn, args, kwargs, traces)

    return routed  # type: ignore[return-value]


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _has_tracer(xs) -> bool:
    return any(isinstance(x, Tracer) for x in xs)


def _call(fn, args, kwargs, traces: _Traces, *, differentiable: bool = True):
    """fn(*args, **kwargs) with its products routed: arrays traced, the rest static,
    and results that are not arrays (None, Python numbers) handed back as `fn`
    returned them. `differentiable`: under a transformation, a function whose
    own JVP is routed (see the module docstring); a JVP rule's evaluation is
    not, so that `checkpoint` can split it into known and unknown parts."""
    if _nnx.holds_graph_nodes(fn, args, kwargs):
        route = functools.partial(_call_pure, traces=traces, differentiable=differentiable)
        return _nnx.call(route, fn, args, kwargs)
    return _call_pure(fn, args, kwargs, traces, differentiable=differentiable)


def _call_pure(fn, args, kwargs, traces: _Traces, *, differentiable: bool):
    """_call for a function and arguments that hold no NNX graph nodes."""
    leaves, in_tree = jax.tree.flatten((args, kwargs))
    dynamic = tuple(map(_is_array, leaves))
    values = [x for x, d in zip(leaves, dynamic) if d]
    trace = traces.get(fn, in_tree, leaves, dynamic, values)
    consts = trace.closed.consts
    if not _has_tracer(values) and not _has_tracer(consts):
        outs = trace.compiled(*values)
    elif differentiable:
        outs = trace.differentiable(*consts, *values)
    else:
        outs = _eval(trace.closed.jaxpr, consts, values)
    return trace.rebuild(outs)


# ---- Traces, cached per argument signature ----


class _Traces:
    """One function's traces by argument signature, as `jax.jit` keeps its own:
    the least recently used go beyond `size`. A trace that captured tracers of
    an enclosing transformation belongs to that call alone and is not kept."""

    def __init__(self, size: int = 64):
        self._size = size
        self._by_signature: collections.OrderedDict = collections.OrderedDict()

    def get(self, fn, in_tree, leaves, dynamic, values) -> _Trace:
        key = _signature(fn, in_tree, leaves, dynamic, values)
        trace = None if key is None else self._by_signature.get(key)
        if trace is not None:
            self._by_signature.move_to_end(key)
            return trace
        trace = _trace(fn, in_tree, leaves, dynamic, values)
        if key is not None and not _has_tracer(trace.closed.consts):
            self._by_signature[key] = trace
            if len(self._by_signature) > self._size:
                self._by_signature.popitem(last=False)
        return trace


def _signature(fn, in_tree, leaves, dynamic, values):
    """What a trace of fn depends on, or None where a static argument is not
    hashable (then every call traces). The configuration (x64, the default
    matmul precision, ...) is part of it, as it is of jit's cache key."""
    static = tuple((type(x), x) for x, d in zip(leaves, dynamic) if not d)
    key = (fn, in_tree, dynamic, static, tuple(map(jax.typeof, values)), _compat.trace_context())
    try:
        hash(key)
    except TypeError:
        return None
    return key


@dataclasses.dataclass(eq=False)
class _Trace:
    """fn traced for one argument signature: its jaxpr (products still
    `dot_general`, routed when evaluated) and its results' structure."""

    closed: ClosedJaxpr
    out_tree: Any
    out_static: list  # the results that are not arrays, None where one is
    out_dynamic: list[bool]

    def rebuild(self, outs):
        outs = iter(outs)
        leaves = [next(outs) if d else x for x, d in zip(self.out_static, self.out_dynamic)]
        return jax.tree.unflatten(self.out_tree, leaves)

    @functools.cached_property
    def compiled(self):
        """Outside any transformation: one jitted function, compiled once."""
        closed = self.closed
        return jax.jit(lambda *values: _eval(closed.jaxpr, closed.consts, values))

    @functools.cached_property
    def differentiable(self):
        """Under a transformation: the routed evaluation of (consts, args), whose
        JVP is the routed evaluation of the jaxpr's JVP."""
        closed, jvp = self.closed, self.jvp

        @jax.custom_jvp
        def call(*consts_and_args):
            n = len(closed.consts)
            return tuple(_eval(closed.jaxpr, consts_and_args[:n], consts_and_args[n:]))

        call.defjvp(jvp, symbolic_zeros=True)
        return call

    @functools.cached_property
    def _jvp_traces(self) -> _Traces:
        return _Traces()

    def jvp(self, primals, tangents):
        """`call`'s JVP rule: jax.jvp of the jaxpr, traced and routed, for the
        nonzero tangents only (a zero one, say a constant's, costs nothing)."""
        nonzero = tuple(
            not isinstance(t, SymbolicZero) and t.dtype != jax.dtypes.float0 for t in tangents
        )
        given = [t for t, nz in zip(tangents, nonzero) if nz]
        outs, out_tangents = _call(
            _jvp_of,
            (self.closed, nonzero, primals, given),
            {},
            self._jvp_traces,
            differentiable=False,
        )
        out_tangents = iter(out_tangents)
        return outs, tuple(
            next(out_tangents) if _differentiable(a) else np.zeros(a.shape, jax.dtypes.float0)
            for a in self.closed.out_avals
        )


def _differentiable(aval) -> bool:
    return primal_dtype_to_tangent_dtype(aval.dtype) != jax.dtypes.float0


def _jvp_of(closed: ClosedJaxpr, nonzero, primals, tangents):
    """jax.jvp of the jaxpr (its constants the first primals) along the
    nonzero tangents; the tangents of its differentiable results."""
    n = len(closed.consts)

    def along(*moving):
        moving = iter(moving)
        args = [next(moving) if nz else p for p, nz in zip(primals, nonzero)]
        return jax.core.eval_jaxpr(closed.jaxpr, args[:n], *args[n:])

    moving = [p for p, nz in zip(primals, nonzero) if nz]
    outs, out_tangents = jax.jvp(along, moving, list(tangents))
    keep = [_differentiable(a) for a in closed.out_avals]
    return tuple(outs), tuple(t for t, k in zip(out_tangents, keep) if k)


def _trace(fn, in_tree, leaves, dynamic, values) -> _Trace:
    result = {}

    def flat_fn(*values):
        it = iter(values)
        args, kwargs = jax.tree.unflatten(
            in_tree, [next(it) if d else x for x, d in zip(leaves, dynamic)]
        )
        out = fn(*args, **kwargs)
        _check_not_updated(fn, (args, kwargs), values)
        result["leaves"], result["tree"] = jax.tree.flatten(out)
        return [x for x in result["leaves"] if _is_array(x)]

    closed = jax.make_jaxpr(flat_fn)(*values)
    out_dynamic = [_is_array(x) for x in result["leaves"]]
    out_static = [None if d else x for x, d in zip(result["leaves"], out_dynamic)]
    return _Trace(closed, result["tree"], out_static, out_dynamic)


def _check_not_updated(fn, arguments, values) -> None:
    """The arguments fn received are copies (rebuilt from their leaves, as
    jax.jit rebuilds them); an array fn put into one would be lost."""
    leaves = jax.tree_util.tree_flatten_with_path(arguments)[0]
    arrays = [(path, x) for path, x in leaves if _is_array(x)]
    if len(arrays) == len(values) and all(x is v for (_, x), v in zip(arrays, values)):
        return
    changed = [
        jax.tree_util.keystr(path) for (path, x), v in zip(arrays, values) if x is not v
    ] or ["its structure"]
    name = getattr(fn, "__name__", repr(fn))
    raise ValueError(
        f"jax_tiled.tiled: {name} updated its arguments in place ({', '.join(changed[:4])}"
        f"{', ...' if len(changed) > 4 else ''} of (args, kwargs)); tiled passes them as "
        "copies, as jax.jit does, so the update would be lost. Return the new values "
        "instead (Flax NNX modules are updated by tiled itself)."
    )


# ---- Which equations change ----


def _routed_dot(eqn) -> bool:
    if eqn.primitive is not dot_general_p:
        return False
    lhs, rhs = (v.aval.dtype for v in eqn.invars)
    return _checks.computed(lhs, rhs, eqn.outvars[0].aval.dtype)


# Primitives whose bodies a kernel compiler (Pallas: Mosaic, Triton) lowers, not
# XLA: it lowers their products itself and knows nothing of tiled_matmul.
_KERNELS = frozenset({"pallas_call", "core_map", "mpmd_map"})


def _has_routed_dot(jaxpr: Jaxpr, seen=None) -> bool:
    seen = {} if seen is None else seen
    key = id(jaxpr)
    if key not in seen:
        seen[key] = False  # cycles do not occur, but a jaxpr may be shared
        seen[key] = any(
            _routed_dot(eqn)
            or (
                eqn.primitive.name not in _KERNELS
                and (
                    _custom_rule(eqn)
                    or any(_has_routed_dot(s, seen) for s in _jaxprs_in(eqn.params))
                )
            )
            for eqn in jaxpr.eqns
        )
    return seen[key]


def _custom_rule(eqn) -> bool:
    """custom_jvp, custom_vjp (and its backward pass in a JVP, custom_lin) and
    custom_vmap: their rules are not jaxprs until used, so they are routed
    whether or not they hold products."""
    return eqn.primitive.name in _CUSTOM_RULES


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
    if eqn.primitive.name not in _KERNELS and (
        _custom_rule(eqn) or any(_has_routed_dot(j) for j in _jaxprs_in(params))
    ):
        special = _HIGHER_ORDER.get(eqn.primitive.name)
        if special is not None:
            return special(eqn, invals)
        params = _rewrite_params(eqn)
    return _compat.bind_with_params(eqn.primitive, invals, params)


# ---- Rewriting the jaxprs that higher-order primitives carry ----

# Rewritten jaxprs by original and configuration (the precision a product
# resolves to), so that an equation evaluated again (an eager call under a
# transformation, say) binds the same jaxpr, which jit finds compiled.
_REWRITTEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _memoized(rewrite):
    @functools.wraps(rewrite)
    def memoized(jaxpr, *args):
        if not _has_routed_dot(jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr):
            return jaxpr
        by_context = _REWRITTEN.setdefault(jaxpr, {})
        context = _compat.trace_context()
        if context not in by_context:
            by_context[context] = rewrite(jaxpr, *args)
        return by_context[context]

    return memoized


def _routed_with_constants_as_inputs(jaxpr: Jaxpr) -> ClosedJaxpr:
    """jaxpr's equations evaluated with its products routed, traced from
    abstract values only: its constants become its first inputs. Their values
    are never read, for they may be a finished trace's (Equinox keeps a copy
    of a closure-converted jaxpr, constants and all, in a tree definition that
    jax does not lift out of the trace). New constants the routing creates
    are the result's own."""
    n = len(jaxpr.constvars)
    avals = [v.aval for v in (*jaxpr.constvars, *jaxpr.invars)]
    return jax.make_jaxpr(lambda *xs: _eval(jaxpr, xs[:n], xs[n:]))(*avals)


@_memoized
def _rewrite_closed(closed: ClosedJaxpr) -> ClosedJaxpr:
    n = len(closed.jaxpr.constvars)
    routed = _routed_with_constants_as_inputs(closed.jaxpr)
    new = routed.jaxpr
    return ClosedJaxpr(
        new.replace(constvars=[*new.constvars, *new.invars[:n]], invars=new.invars[n:]),
        [*routed.consts, *closed.consts],
    )


@_memoized
def _rewrite_open(jaxpr: Jaxpr, primitive: str) -> Jaxpr:
    """An open jaxpr rewritten to the same signature: its constants stay
    constants (the primitive supplies them: Equinox's closure-converted
    functions, Pallas-style bodies), its inputs inputs."""
    n = len(jaxpr.constvars)
    routed = _routed_with_constants_as_inputs(jaxpr)
    if routed.consts:
        raise NotImplementedError(
            f"jax_tiled.tiled: routing the products inside {primitive} would give its body "
            f"{len(routed.consts)} new array constant(s), which it has no way to pass"
        )
    new = routed.jaxpr
    return new.replace(constvars=new.invars[:n], invars=new.invars[n:])


def _rewrite_params(eqn) -> dict:
    return {k: _rewrite_deep(v, eqn.primitive.name) for k, v in eqn.params.items()}


# Where a primitive's parameters may hold jaxprs: directly, in tuples (named
# ones too: custom_linear_solve's), lists and dicts, and in the node data of
# pytree definitions. Equinox's primitives (lineax's linear_solve) keep a
# closure-converted function's jaxpr both as a parameter and inside the
# definition of a tree that holds it again, and compare the two copies when
# they run: every copy is rewritten, to the same new jaxpr.


def _children(x):
    """The parts of a parameter that may hold jaxprs, and how to rebuild it
    from new ones; None for anything else."""
    if isinstance(x, (tuple, list)):
        if hasattr(x, "_fields"):
            return list(x), lambda items: type(x)(*items)
        return list(x), type(x)
    if isinstance(x, dict):
        return list(x.values()), lambda items: type(x)(zip(x.keys(), items))
    if isinstance(x, jax.tree_util.PyTreeDef) and x.node_data() is not None:
        node_type, data = x.node_data()
        children = x.children()

        def rebuild(items):
            return jax.tree_util.PyTreeDef.from_node_data_and_children(
                jax.tree_util.default_registry, (node_type, items[0]), items[1:]
            )

        return [data, *children], rebuild
    return None


def _jaxprs_in(params: dict):
    """Every jaxpr among an equation's parameters (open: a closed one's jaxpr)."""
    stack = list(params.values())
    while stack:
        x = stack.pop()
        if isinstance(x, ClosedJaxpr):
            yield x.jaxpr
        elif isinstance(x, Jaxpr):
            yield x
        else:
            parts = _children(x)
            if parts is not None:
                stack.extend(parts[0])


def _rewrite_deep(x, primitive: str):
    """x with every jaxpr in it rewritten (the same object where none changes)."""
    if isinstance(x, ClosedJaxpr):
        return _rewrite_closed(x)
    if isinstance(x, Jaxpr):
        return _rewrite_open(x, primitive)
    parts = _children(x)
    if parts is None:
        return x
    items, rebuild = parts
    new = [_rewrite_deep(item, primitive) for item in items]
    return x if all(a is b for a, b in zip(new, items)) else rebuild(new)


def _remat(eqn, invals):
    params = _rewrite_params(eqn)
    params["policy"] = checkpoint_policies.knowing_tiled_matmul(params.get("policy"))
    return _compat.bind_with_params(eqn.primitive, invals, params)


def _wrapped(fun, f: Callable):
    """f in place of a rule `fun`, as the parameter held it (a WrappedFun or a callable)."""
    return lu.wrap_init(f, debug_info=fun.debug_info) if isinstance(fun, lu.WrappedFun) else f


def _call_fun(fun, args):
    return fun.call_wrapped(*args) if isinstance(fun, lu.WrappedFun) else fun(*args)


def _routed_jaxpr_fun(fun):
    """A rule that returns (jaxpr, consts, ...) for some arguments, returning
    the routed jaxpr instead."""

    @functools.cache
    def routed(*args):
        jaxpr, consts, *rest = _call_fun(fun, args)
        closed = _rewrite_closed(ClosedJaxpr(jaxpr, consts))
        return (closed.jaxpr, closed.consts, *rest)

    return _wrapped(fun, routed)


def _routed_rule(fun):
    """A rule that computes on values (a custom_vjp's bwd, a custom_vmap's
    rule), called routed."""
    traces = _Traces()
    return _wrapped(fun, lambda *args: _call(_call_fun, (fun, args), {}, traces))


def _custom_jvp_call(eqn, invals):
    params = _rewrite_params(eqn)
    key = next(k for k in ("jvp_jaxpr_fun", "jvp_jaxpr_thunk") if k in params)
    params[key] = _routed_jaxpr_fun(params[key])
    return _compat.bind_with_params(eqn.primitive, invals, params)


def _custom_vjp_call(eqn, invals):
    params = _rewrite_params(eqn)
    params["fwd_jaxpr_thunk"] = _routed_jaxpr_fun(params["fwd_jaxpr_thunk"])
    params["bwd"] = _routed_rule(params["bwd"])
    return _compat.bind_with_params(eqn.primitive, invals, params)


def _custom_lin(eqn, invals):
    """A custom_vjp function's backward pass, left in a JVP's jaxpr to run
    when it is transposed."""
    params = dict(eqn.params)
    params["bwd"] = _routed_rule(params["bwd"])
    return _compat.bind_with_params(eqn.primitive, invals, params)


def _custom_vmap_call(eqn, invals):
    """The batching rule runs when the call is vmapped, after the rewrite."""
    params = _rewrite_params(eqn)
    params["rule"] = _routed_rule(params["rule"])
    return _compat.bind_with_params(eqn.primitive, invals, params)


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
    "custom_lin": _custom_lin,
    "custom_vmap_call": _custom_vmap_call,
    "shard_map": _shard_map,
}
_CUSTOM_RULES = frozenset(
    {
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "custom_lin",
        "custom_vmap_call",
    }
)
