"""The benchmark CLI runs end to end on tiny problems and writes its JSON."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jax_tiled
from jax_tiled.bench import chains, cli, harness, train_step

from helpers import count_equations, equations

TINY_STEP = ["--train-step", "--width", "64", "--tokens", "32", "--dtype", "float32",
             "--repeats", "5", "--no-progress"]


def test_bench_runs_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    assert cli.main(["--shapes", "96x64x80", "--repeats", "5", "--no-progress",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    kernels = {row["kernel"] for row in result["rows"]}
    assert {"jnp.matmul", "auto"} <= kernels
    assert all(row.get("error") is None for row in result["rows"])


def test_text_table_has_every_column_on_every_row(capsys):
    """A row without a bandwidth figure (not skinny) still fills that cell, so
    splitting a line on whitespace gives each column where the header has it."""
    assert cli.main(["--shapes", "96x64x80,160^3", "--repeats", "5", "--no-progress",
                     "--no-check", "--dtype", "float32", "--precision", "highest"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("shape"))
    columns = lines[head].replace("x peer", "x_peer").split()
    body = [line.split() for line in lines[head + 2:] if line.startswith(("96x64x80", "160^3"))]
    assert {row[0] for row in body} == {"96x64x80", "160^3"}
    for row in body:
        assert len(row) == len(columns), row
        ratio = row[columns.index("x_peer")]
        assert ratio == "peer" or float(ratio) > 0, row


def run_tiny_step(tmp_path) -> tuple[int, dict, dict]:
    """The exit status, the JSON document, and its rows by kernel."""
    out = tmp_path / "step.json"
    status = cli.main([*TINY_STEP, "--json", str(out)])
    result = json.loads(out.read_text())
    return status, result, {row["kernel"]: row for row in result["rows"]}


def test_train_step_times_ours_against_the_peer(tmp_path, capsys):
    status, result, rows = run_tiny_step(tmp_path)
    assert status == 0
    assert result["train_step"]["flops_per_step"] == 6 * 2 * 32 * 64 * 64
    assert set(rows) == {"jnp.matmul", "auto"}
    for row in rows.values():
        assert row["error"] is None and row["ms"] > 0 and row["tflops"] > 0
        assert math.isfinite(row["loss"]) and row["loss"] > 0
    ours = rows["auto"]
    assert math.isfinite(ours["ratio"]) and ours["ratio"] > 0
    assert ours["grad_diff"] <= ours["tolerance"] and ours["loss_diff"] <= ours["tolerance"]
    printed = capsys.readouterr().out
    assert "width 64, 32 tokens" in printed
    assert any(line.split()[2:3] == ["auto"] for line in printed.splitlines())


@jax.custom_vjp
def _wrong_cotangent(y):
    return y


_wrong_cotangent.defvjp(lambda y: (y, None), lambda _, ct: (ct * 1.05,))

# A wrong kernel, as seen by the step: its product off by 5%, or only its VJP off
# (the loss then agrees, so only the gradient check can catch it).
WRONG_PRODUCTS = {
    "forward": lambda right: lambda a, b, **kw: right(a, b, **kw) * 1.05,
    "backward": lambda right: lambda a, b, **kw: _wrong_cotangent(right(a, b, **kw)),
}


@pytest.mark.parametrize("wrong", sorted(WRONG_PRODUCTS))
def test_train_step_fails_when_our_products_are_wrong(tmp_path, capsys, monkeypatch, wrong):
    monkeypatch.setattr(jax_tiled, "matmul", WRONG_PRODUCTS[wrong](jax_tiled.matmul))
    status, _, rows = run_tiny_step(tmp_path)
    assert status == 1
    ours = rows["auto"]
    assert ours["error"].startswith("disagrees with jnp.matmul")
    assert ours["ratio"] is None
    assert ours["grad_diff"] > ours["tolerance"]
    if wrong == "backward":  # caught by the gradients alone
        assert ours["loss_diff"] <= ours["tolerance"]
    assert rows["jnp.matmul"]["error"] is None
    assert "training step FAILED with auto" in capsys.readouterr().err


@pytest.mark.parametrize("model", sorted(train_step.MODELS))
@pytest.mark.parametrize("kernel, product", [("jnp.matmul", "dot_general"),
                                             ("auto", "tiled_matmul")])
def test_train_step_runs_the_products_it_counts(model, kernel, product):
    step_model = train_step.MODELS[model]
    size = train_step.StepSize(width=128, tokens=8, sequences=3)
    operands = [jnp.ones(shape) for shape, _ in step_model.arrays(size)]
    jaxpr = jax.make_jaxpr(train_step.train_step_fn("default", kernel, step_model))(*operands)
    products = step_model.products(size)
    assert count_equations(jaxpr, product) == len(products)
    # The FLOPs it reports are those of the products the step runs.
    assert sum(p.flops for p in products) == sum(
        2 * math.prod(e.outvars[0].aval.shape) * _contracted(e)
        for e in equations(jaxpr, product))


def _contracted(eqn) -> int:
    """The contracted size of a dot_general or tiled_matmul equation."""
    a = eqn.invars[0].aval.shape
    if eqn.primitive.name == "dot_general":
        (contract_a, _), _ = eqn.params["dimension_numbers"]
        return math.prod(a[d] for d in contract_a)
    return a[1] if eqn.params["transpose_a"] else a[2]


def test_attention_step_times_ours_against_the_peer(tmp_path):
    out = tmp_path / "step.json"
    status = cli.main(["--train-step", "--model", "attention", "--width", "128", "--tokens",
                       "16", "--sequences", "2", "--dtype", "float32", "--repeats", "5",
                       "--no-progress", "--json", str(out)])
    result = json.loads(out.read_text())
    assert status == 0
    assert result["train_step"]["model_name"] == "attention"
    assert result["train_step"]["sequences"] == 2
    ours = {row["kernel"]: row for row in result["rows"]}["auto"]
    assert ours["error"] is None and math.isfinite(ours["ratio"])
    assert ours["grad_diff"] <= ours["tolerance"]


TINY_CHAIN = ["--chain", "--sizes", "16,24", "--chain-length", "3", "--dtype", "float32",
              "--repeats", "5", "--no-progress"]


def run_tiny_chain(tmp_path) -> tuple[int, dict]:
    out = tmp_path / "chain.json"
    status = cli.main([*TINY_CHAIN, "--json", str(out)])
    return status, json.loads(out.read_text())


def test_chains_time_ours_against_the_peer_per_product(tmp_path, capsys):
    status, result = run_tiny_chain(tmp_path)
    assert status == 0
    assert result["chains"]["length"] == 3 and result["chains"]["sizes"] == [16, 24]
    rows = {(r["form"], r["size"], r["kernel"]): r for r in result["rows"]}
    assert set(rows) == {(form, size, kernel) for form in chains.FORMS for size in (16, 24)
                         for kernel in ("jnp.matmul", "auto")}
    for (form, size, kernel), row in rows.items():
        assert row["error"] is None and row["us_per_product"] > 0
        assert row["us_per_product"] == pytest.approx(row["ms"] * 1e3 / 3)
        if kernel == "auto":
            assert math.isfinite(row["ratio"]) and row["ratio"] > 0
            assert row["diff"] <= row["tolerance"]
    printed = capsys.readouterr().out
    assert "3 dependent products" in printed
    assert sum(line.split()[:1] == ["unrolled"] for line in printed.splitlines()) == 4


def test_chains_fail_when_our_products_are_wrong(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(jax_tiled, "matmul", WRONG_PRODUCTS["forward"](jax_tiled.matmul))
    status, result = run_tiny_chain(tmp_path)
    assert status == 1
    ours = [r for r in result["rows"] if r["kernel"] == "auto"]
    assert ours and all(r["error"].startswith("disagrees with the peer") for r in ours)
    assert all(r["ratio"] is None for r in ours)
    assert "chain FAILED with auto" in capsys.readouterr().err


@pytest.mark.parametrize("form", chains.FORMS)
@pytest.mark.parametrize("kernel, product", [("jnp.matmul", "dot_general"),
                                             ("auto", "tiled_matmul")])
def test_chains_run_the_products_they_count(form, kernel, product):
    length, size = 5, 8
    jaxpr = jax.make_jaxpr(chains.chain_fn(form, length, "default", kernel))(
        jnp.ones((size, size)), jnp.ones((length, size, size)))
    # A scan's body holds its one product; unrolled, each layer has its own.
    assert count_equations(jaxpr, product) == (1 if form == "scan" else length)
    assert count_equations(jaxpr, "scan") == (form == "scan")


@pytest.mark.parametrize("argv", [["--sizes", "64"], ["--chain-length", "8"],
                                  ["--model", "attention"], ["--train-step", "--sequences", "2"],
                                  ["--train-step", "--model", "conv"],
                                  ["--chain", "--train-step"], ["--chain", "--shapes", "64^3"],
                                  ["--chain", "--sizes", "0"], ["--chain", "--sizes", "x"]])
def test_chain_arguments_are_checked(argv):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)


def test_float32_rows_run_every_precision():
    assert harness.precisions_for("float32", None) == ["default", "high", "highest"]
    assert harness.precisions_for("bfloat16", None) == ["default"]
    assert harness.precisions_for("float32", ["high"]) == ["high"]


def test_each_precision_times_the_kernels_that_take_it(monkeypatch):
    """A float32 'highest' row leaves out the tensor-core kernels (they refuse
    true fp32); 'default' and 'high' rows time them. Named kernels are timed as asked."""
    def kernels(backend=None, dtype=None, out_dtype=None, precision=None):
        assert backend is None and dtype == jnp.float32
        return ["warptile"] if precision == "highest" else ["warptile", "mma"]

    monkeypatch.setattr(jax_tiled, "kernels", kernels)
    available = ["warptile", "mma", "auto"]
    assert harness.kernels_for("float32", "highest", available, False) == ["warptile", "auto"]
    for precision in ("default", "high"):
        assert harness.kernels_for("float32", precision, available, False) == available
    assert harness.kernels_for("float32", "highest", ["mma"], True) == ["mma"]


def test_rows_per_precision_share_their_peers():
    by_precision = {"default": ["a", "b"], "high": ["a", "b", "c"], "highest": ["a"]}
    measure = lambda p, k: types.SimpleNamespace(precision=p, kernel=k, ms=1.0, error=None)
    rows = harness.measure_against_peers(by_precision, measure)
    assert [(r.precision, r.kernel) for r in rows] == [
        ("default", "jnp.matmul"), ("default", "a"), ("default", "b"),
        ("highest", "jnp.matmul"), ("high", "a"), ("high", "b"), ("high", "c"),
        ("highest", "a")]
    assert [r.peer_precision for r in rows if r.kernel != "jnp.matmul"] == [
        "default", "default", "highest", "highest", "highest", "highest"]
    assert harness.count_rows(by_precision) == len(rows)


def test_module_entry_point_lists_the_suites():
    """`python -m jax_tiled.bench` runs the package's __main__."""
    result = subprocess.run([sys.executable, "-m", "jax_tiled.bench", "--list-shapes"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "GPU suite: 512^3" in result.stdout and "CPU --quick: 256^3" in result.stdout


def test_scaling_tool_runs_on_the_shared_timing():
    """tools/scaling.py times through the bench's timing module; on CPU devices
    (four, from conftest's XLA_FLAGS) at a tiny size it prints a row per layout
    and overlap setting: the milliseconds, the efficiencies and the ratio."""
    script = Path(__file__).resolve().parent.parent / "tools" / "scaling.py"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the four CPU devices, on a GPU machine too
    result = subprocess.run([sys.executable, str(script), "--size", "64", "--repeats", "5",
                             "--no-overlap"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("---"))) + 1:]
    layouts = ("M-sharded", "N-sharded", "K-sharded, replicated", "K-sharded, reduce-scatter",
               "all-gather (a by M, b by N)")
    assert [(line[:28].strip(), line[28:41].strip()) for line in table] == [
        (layout, label) for layout in layouts for label in ("chunks=auto", "no overlap")]
    for line in table:
        ours, theirs, ours_eff, theirs_eff, ratio = line[41:].split()
        assert float(ours) > 0 and float(theirs) > 0 and ratio.endswith("x")
        assert ours_eff.endswith("%") and theirs_eff.endswith("%")
