"""jax.export of functions that use jax_tiled: symbolic batch, M, K and N as
jnp.matmul exports them, the safety checks to disable, serialization, and the
loading side (a fresh process that imports jax_tiled)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import flatbuffers  # noqa: F401  (a test dependency: jax.export serializes with it)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_tiled
from helpers import F32, HIGHEST, random_array

b, m, k, n = export.symbolic_shape("b, m, k, n")
# The target jax.export lowers for: that of the default backend.
TARGET = "tiled_matmul_cuda" if jax.default_backend() == "gpu" else "tiled_matmul_cpu"


def S(*shape):
    return jax.ShapeDtypeStruct(shape, F32)


def dg(dims):
    return lambda x, y: jax_tiled.dot_general(x, y, dims, precision=HIGHEST)


def mm(x, y):
    return jax_tiled.matmul(x, y, precision=HIGHEST)


def loss_grad(f):
    return jax.grad(lambda x, y: jnp.sum(jnp.sin(f(x, y))), (0, 1))


# (name, function, jnp's function, symbolic argument shapes, concrete shapes to call with)
CASES = [
    (
        "b,m,k @ k,n",
        mm,
        jnp.matmul,
        (S(b, m, k), S(k, n)),
        [((2, 3, 5), (5, 4)), ((1, 7, 2), (2, 1))],
    ),
    (
        "b,m,k @ b,k,n",
        mm,
        jnp.matmul,
        (S(b, m, k), S(b, k, n)),
        [((2, 3, 5), (2, 5, 4)), ((3, 1, 6), (3, 6, 2))],
    ),
    (
        "m,k @ b,k,n",
        mm,
        jnp.matmul,
        (S(m, k), S(b, k, n)),
        [((3, 5), (2, 5, 4)), ((4, 2), (1, 2, 3))],
    ),
    ("k @ k,n", mm, jnp.matmul, (S(k), S(k, n)), [((5,), (5, 4)), ((1,), (1, 6))]),
    ("m,k @ k", mm, jnp.matmul, (S(m, k), S(k)), [((3, 5), (5,)), ((6, 2), (2,))]),
    (
        "dot_general b,m,k . b,n,k",
        dg((((2,), (2,)), ((0,), (0,)))),
        lambda x, y: jax.lax.dot_general(x, y, (((2,), (2,)), ((0,), (0,)))),
        (S(b, m, k), S(b, n, k)),
        [((2, 3, 5), (2, 4, 5)), ((1, 1, 3), (1, 2, 3))],
    ),
    (
        "grad b,m,k @ k,n",
        loss_grad(mm),
        loss_grad(jnp.matmul),
        (S(b, m, k), S(k, n)),
        [((2, 3, 5), (5, 4)), ((3, 2, 2), (2, 3))],
    ),
    (
        "grad m,k @ b,k,n",
        loss_grad(mm),
        loss_grad(jnp.matmul),
        (S(m, k), S(b, k, n)),
        [((3, 5), (2, 5, 4)), ((2, 2), (3, 2, 3))],
    ),
    (
        "tiled einsum",
        jax_tiled.tiled(lambda x, y: jnp.einsum("bmk,nk->bmn", x, y, precision=HIGHEST)),
        lambda x, y: jnp.einsum("bmk,nk->bmn", x, y),
        (S(b, m, k), S(n, k)),
        [((2, 3, 5), (4, 5)), ((1, 2, 3), (6, 3))],
    ),
]


@pytest.mark.parametrize("name,f,reference,args,calls", CASES, ids=[c[0] for c in CASES])
def test_export_with_symbolic_shapes_round_trip(rng, name, f, reference, args, calls):
    exported = export.export(jax.jit(f), disabled_checks=jax_tiled.export_disabled_checks())(*args)
    text = exported.mlir_module()
    assert TARGET in text and "stablehlo.dot_general" not in text
    # jnp exports the same function with the same result types.
    theirs = export.export(jax.jit(reference))(*args)
    assert exported.out_avals == theirs.out_avals
    loaded = export.deserialize(exported.serialize())
    for shapes in calls:
        operands = [random_array(rng, s, F32) for s in shapes]
        with jax.default_matmul_precision("highest"):
            want = reference(*operands)
        jax.tree.map(
            lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5),
            loaded.call(*operands),
            want,
        )


def test_export_without_disabled_checks_names_the_custom_call():
    with pytest.raises(ValueError, match=TARGET):
        export.export(jax.jit(jax_tiled.matmul))(S(b, m, k), S(k, n))


def test_disabled_checks_cover_every_platform():
    checks = jax_tiled.export_disabled_checks()
    assert checks == [
        export.DisabledSafetyCheck.custom_call("tiled_matmul_cpu"),
        export.DisabledSafetyCheck.custom_call("tiled_matmul_cuda"),
    ]


LOADER = Path(__file__).resolve().parent / "scripts" / "export_loader.py"


def test_the_loading_process_must_import_jax_tiled(tmp_path):
    # For the CPU, where the loading process runs.
    exported = export.export(
        jax.jit(jax_tiled.matmul),
        platforms=("cpu",),
        disabled_checks=jax_tiled.export_disabled_checks(),
    )(S(b, k), S(k, n))
    blob = tmp_path / "matmul.jax"
    blob.write_bytes(exported.serialize())
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = lambda mode: subprocess.run(
        [sys.executable, str(LOADER), str(blob), mode],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    ok = run("import")
    assert ok.returncode == 0 and "loaded and called: (5, 2)" in ok.stdout, ok.stderr
    bare = run("no-import")
    assert bare.returncode != 0
    assert "No FFI handler registered for tiled_matmul_cpu" in bare.stderr, bare.stderr
