"""The benchmark CLI runs end to end on tiny problems and writes its JSON."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tiled
from helpers import count_equations, equations
from jax_tiled.bench import accuracy, chains, cli, harness, products, report, shapes, train_step

TINY_STEP = [
    "--train-step",
    "--width",
    "64",
    "--tokens",
    "32",
    "--dtype",
    "float32",
    "--repeats",
    "5",
    "--no-progress",
]


def test_bench_runs_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    assert (
        cli.main(["--shapes", "96x64x80", "--repeats", "5", "--no-progress", "--json", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    kernels = {row["kernel"] for row in result["rows"]}
    assert {"jnp.matmul", "auto"} <= kernels
    assert all(row.get("error") is None for row in result["rows"])


def test_out_dtype_times_16_bit_products_into_float32_too(tmp_path, monkeypatch, capsys):
    """--out-dtype same,float32: each 16-bit product twice, the second into
    float32 for ours and the peer alike (its own peer row, ratio and geometric
    mean); float32 operands once."""
    asked = {"ours": set(), "peer": set()}
    ours, peer = jax_tiled.matmul, jnp.matmul

    def recording(record, mm):
        def wrapped(a, b, *, preferred_element_type=None, **kwargs):
            asked[record].add((np.dtype(a.dtype).name, preferred_element_type))
            return mm(a, b, preferred_element_type=preferred_element_type, **kwargs)

        return wrapped

    monkeypatch.setattr(jax_tiled, "matmul", recording("ours", ours))
    monkeypatch.setattr(jnp, "matmul", recording("peer", peer))
    out = tmp_path / "wide.json"
    argv = ["--shapes", "96x64x80", "--dtype", "bfloat16,float32", "--kernels", "auto"]
    argv += ["--precision", "default", "--out-dtype", "same,float32", "--repeats", "5"]
    assert cli.main([*argv, "--no-progress", "--no-pallas", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["out_dtype"], r["kernel"]) for r in rows] == [
        ("bfloat16", None, "jnp.matmul"),
        ("bfloat16", None, "auto"),
        ("bfloat16", "float32", "jnp.matmul"),
        ("bfloat16", "float32", "auto"),
        ("float32", None, "jnp.matmul"),
        ("float32", None, "auto"),
    ]
    assert all(r["error"] is None and r["rel_error"] < 1e-2 for r in rows)
    # into float32 the result is float32's rounding, not bfloat16's
    wide = [r for r in rows if r["out_dtype"]]
    assert all(r["rel_error"] < 1e-5 for r in wide), wide
    for who in ("ours", "peer"):
        assert asked[who] == {("bfloat16", None), ("bfloat16", "float32"), ("float32", None)}
    printed = capsys.readouterr().out
    assert "bfloat16->float32" in printed.split("geometric mean")[1]


@pytest.mark.parametrize("mode", ["--accuracy", "--chain", "--train-step"])
def test_out_dtype_goes_with_the_product_suite(mode, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args([mode, "--out-dtype", "float32"])
    assert "--out-dtype goes with the product suite" in capsys.readouterr().err


def test_an_unknown_out_dtype_is_an_error(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--out-dtype", "float16"])
    assert "unknown output dtype ['float16']" in capsys.readouterr().err


def test_text_table_has_every_column_on_every_row(capsys):
    """A row without a bandwidth figure (not skinny) still fills that cell, so
    splitting a line on whitespace gives each column where the header has it."""
    assert (
        cli.main(
            [
                "--shapes",
                "96x64x80,160^3",
                "--repeats",
                "5",
                "--no-progress",
                "--no-check",
                "--dtype",
                "float32",
                "--precision",
                "highest",
                "--no-pallas",  # its rows and columns: tests/test_bench_pallas.py
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("shape"))
    columns = lines[head].replace("x peer", "x_peer").split()
    body = [line.split() for line in lines[head + 2 :] if line.startswith(("96x64x80", "160^3"))]
    assert {row[0] for row in body} == {"96x64x80", "160^3"}
    for row in body:
        assert len(row) == len(columns), row
        ratio = row[columns.index("x_peer")]
        assert ratio == "peer" or float(ratio) > 0, row


def test_text_table_keeps_a_gpu_rows_bandwidth_share_in_its_own_column():
    """On a GPU the share of HBM bandwidth is known: a skinny row then has a GB/s
    figure and a %HBM figure, each its own column (once they shared a cell, and a
    whitespace split found 12 cells against 10 columns). Built by hand, so the CPU
    runs it too."""
    fields = dict(
        shape="4096x4096x128",
        batch=1,
        m=4096,
        k=4096,
        n=128,
        transpose="",
        dtype="bfloat16",
        precision="default",
        sets=8,
        ms=0.05,
        tflops=85.9,
        gbps=1400.0,
        ratio=1.1,
        rel_error=2e-3,
    )
    rows = [
        products.Row(kernel="jnp.matmul", **fields),
        products.Row(kernel="wgmma", **fields),
        products.Row(kernel="auto", **{**fields, "gbps": None}),
    ]
    lines = report.format_table(rows, report.hbm_gbps("NVIDIA H100 80GB HBM3")).splitlines()
    columns = lines[0].replace("x peer", "x_peer").split()
    cells = [line.split() for line in lines[2:]]
    assert all(len(row) == len(columns) for row in cells), (columns, cells)
    assert [row[columns.index("%HBM")] for row in cells] == ["42", "42", "-"]
    assert [row[columns.index("GB/s")] for row in cells] == ["1400", "1400", "-"]


@pytest.mark.parametrize("cell", ["1400 (42% HBM)", ""])
def test_text_table_refuses_a_cell_a_whitespace_split_would_misread(cell):
    row = types.SimpleNamespace(error=None)
    with pytest.raises(ValueError, match="non-empty words"):
        report._text_table(("a", "b"), [row], lambda _: ("x", cell), left=1)
    with pytest.raises(ValueError, match="3 cells against 2 columns"):
        report._text_table(("a", "b"), [row], lambda _: ("x", "y", "z"), left=1)


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
    ours, peer = rows["auto"], rows["jnp.matmul"]
    assert math.isfinite(ours["ratio"]) and ours["ratio"] > 0
    # Both sides are measured against the truth, and ours records the peer's distance.
    assert set(ours["err"]) == {"loss", "grad"} and ours["peer_err"] == peer["err"]
    assert max(ours["err"].values()) <= ours["tolerance"]
    printed = capsys.readouterr().out
    assert "width 64, 32 tokens" in printed and "relative distance to the truth" in printed
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
    assert ours["error"].startswith("disagrees with the truth: ")
    assert "grad off by" in ours["error"]
    assert ours["ratio"] is None
    assert ours["err"]["grad"] > max(ours["tolerance"], 2 * ours["peer_err"]["grad"])
    if wrong == "backward":  # caught by the gradients alone
        assert ours["err"]["loss"] <= ours["tolerance"]
    assert rows["jnp.matmul"]["error"] is None
    assert "training step FAILED with auto" in capsys.readouterr().err


def _sloppy_peer(matmul_fn):
    """matmul_fn with the peer's products 5% off, except at the truth's precision:
    a peer less accurate than ours, as TF32 is on a GPU."""

    def sloppy(precision, kernel, out_dtype=None):
        mm = matmul_fn(precision, kernel, out_dtype)
        if kernel != harness.PEER or precision == harness.TRUTH_PRECISION:
            return mm
        return lambda a, b: mm(a, b) * 1.05

    return sloppy


def test_train_step_passes_a_kernel_closer_to_the_truth_than_the_peer(tmp_path, monkeypatch):
    """Ours is judged by its distance to the truth: a kernel that disagrees with an
    inaccurate peer, but is closer to the truth than it, passes."""
    monkeypatch.setattr(train_step, "matmul_fn", _sloppy_peer(train_step.matmul_fn))
    status, _, rows = run_tiny_step(tmp_path)
    ours, peer = rows["auto"], rows["jnp.matmul"]
    assert status == 0 and ours["error"] is None and peer["error"] is None
    # The peer is far past the tolerance (ours is as far from the peer's result, which
    # failed ours when the peer was the reference), and ours is close to the truth.
    assert peer["err"]["grad"] > 5 * ours["tolerance"]
    assert ours["err"]["grad"] < min(ours["tolerance"], 1e-2 * peer["err"]["grad"])


@pytest.mark.parametrize(
    "err, peer_err, fails",
    [
        (3e-2, 2e-2, False),  # past the tolerance, but within 2x the peer's
        (5e-2, 2e-2, True),  # past both
        (5e-3, 0.0, False),  # within the tolerance of an exact peer
        (2e-2, None, True),  # no peer: the tolerance alone
        (float("nan"), 1e-3, True),  # not finite
        (5e-3, float("nan"), False),  # a peer that is not finite widens nothing
    ],
)
def test_rows_are_judged_by_their_distance_to_the_truth(err, peer_err, fails):
    row = types.SimpleNamespace(is_peer=False, error=None)
    peer_errs = None if peer_err is None else {"x": peer_err}
    harness.judge_against_truth(row, {"x": err}, peer_errs, tolerance=1e-2)
    assert (row.error is not None) == fails, row.error
    assert row.err == {"x": err} and row.peer_err == peer_errs and row.tolerance == 1e-2
    peer_row = types.SimpleNamespace(is_peer=True, error=None)
    harness.judge_against_truth(peer_row, {"x": 1.0}, None, tolerance=1e-2)
    assert peer_row.error is None  # the peer is measured, never failed


@pytest.mark.parametrize("model", sorted(train_step.MODELS))
@pytest.mark.parametrize(
    "kernel, product", [("jnp.matmul", "dot_general"), ("auto", "tiled_matmul")]
)
def test_train_step_runs_the_products_it_counts(model, kernel, product):
    step_model = train_step.MODELS[model]
    size = train_step.StepSize(width=128, tokens=8, sequences=3)
    operands = [jnp.ones(shape) for shape, _ in step_model.arrays(size)]
    jaxpr = jax.make_jaxpr(train_step.train_step_fn("default", kernel, step_model))(*operands)
    products = step_model.products(size)
    assert count_equations(jaxpr, product) == len(products)
    # The FLOPs it reports are those of the products the step runs.
    assert sum(p.flops for p in products) == sum(
        2 * math.prod(e.outvars[0].aval.shape) * _contracted(e) for e in equations(jaxpr, product)
    )


def _contracted(eqn) -> int:
    """The contracted size of a dot_general or tiled_matmul equation."""
    a = eqn.invars[0].aval.shape
    if eqn.primitive.name == "dot_general":
        (contract_a, _), _ = eqn.params["dimension_numbers"]
        return math.prod(a[d] for d in contract_a)
    return a[1] if eqn.params["transpose_a"] else a[2]


def test_attention_step_times_ours_against_the_peer(tmp_path):
    out = tmp_path / "step.json"
    status = cli.main(
        [
            "--train-step",
            "--model",
            "attention",
            "--width",
            "128",
            "--tokens",
            "16",
            "--sequences",
            "2",
            "--dtype",
            "float32",
            "--repeats",
            "5",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert status == 0
    assert result["train_step"]["model_name"] == "attention"
    assert result["train_step"]["sequences"] == 2
    ours = {row["kernel"]: row for row in result["rows"]}["auto"]
    assert ours["error"] is None and math.isfinite(ours["ratio"])
    assert max(ours["err"].values()) <= ours["tolerance"]


TINY_CHAIN = [
    "--chain",
    "--sizes",
    "16,24",
    "--chain-length",
    "3",
    "--dtype",
    "float32",
    "--repeats",
    "5",
    "--no-progress",
]


def run_tiny_chain(tmp_path) -> tuple[int, dict]:
    out = tmp_path / "chain.json"
    status = cli.main([*TINY_CHAIN, "--json", str(out)])
    return status, json.loads(out.read_text())


def test_chains_time_ours_against_the_peer_per_product(tmp_path, capsys):
    status, result = run_tiny_chain(tmp_path)
    assert status == 0
    assert result["chains"]["length"] == 3 and result["chains"]["sizes"] == [16, 24]
    rows = {(r["form"], r["size"], r["kernel"]): r for r in result["rows"]}
    assert set(rows) == {
        (form, size, kernel)
        for form in chains.FORMS
        for size in (16, 24)
        for kernel in ("jnp.matmul", "auto")
    }
    for (_, _, kernel), row in rows.items():
        assert row["error"] is None and row["us_per_product"] > 0
        assert row["sets"] == 1  # one chain per jitted call (chains.py)
        assert row["us_per_product"] == pytest.approx(row["ms"] * 1e3 / 3)
        assert row["err"]["x"] <= row["tolerance"]
        if kernel == "auto":
            assert math.isfinite(row["ratio"]) and row["ratio"] > 0
            assert row["peer_err"]["x"] <= row["tolerance"]
    printed = capsys.readouterr().out
    assert "3 dependent products" in printed
    assert sum(line.split()[:1] == ["unrolled"] for line in printed.splitlines()) == 4


def test_chains_fail_when_our_products_are_wrong(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(jax_tiled, "matmul", WRONG_PRODUCTS["forward"](jax_tiled.matmul))
    status, result = run_tiny_chain(tmp_path)
    assert status == 1
    ours = [r for r in result["rows"] if r["kernel"] == "auto"]
    assert ours and all(r["error"].startswith("disagrees with the truth: x off by") for r in ours)
    assert all(r["ratio"] is None for r in ours)
    assert "chain FAILED with auto" in capsys.readouterr().err


@pytest.mark.parametrize("form", chains.FORMS)
@pytest.mark.parametrize(
    "kernel, product", [("jnp.matmul", "dot_general"), ("auto", "tiled_matmul")]
)
def test_chains_run_the_products_they_count(form, kernel, product):
    length, size = 5, 8
    jaxpr = jax.make_jaxpr(chains.chain_fn(form, length, "default", kernel))(
        jnp.ones((size, size)), jnp.ones((length, size, size))
    )
    # A scan's body holds its one product; unrolled, each layer has its own.
    assert count_equations(jaxpr, product) == (1 if form == "scan" else length)
    assert count_equations(jaxpr, "scan") == (form == "scan")


@pytest.mark.parametrize(
    "argv",
    [
        ["--sizes", "64"],
        ["--chain-length", "8"],
        ["--model", "attention"],
        ["--train-step", "--sequences", "2"],
        ["--train-step", "--model", "conv"],
        ["--chain", "--train-step"],
        ["--chain", "--shapes", "64^3"],
        ["--chain", "--sizes", "0"],
        ["--chain", "--sizes", "x"],
        ["--accuracy", "--chain"],
        ["--accuracy", "--train-step"],
        ["--accuracy", "--quick"],
        ["--accuracy", "--plot", "a.png"],
    ],
)
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
        return ["warptile"] if precision == jax.lax.Precision.HIGHEST else ["warptile", "mma"]

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
        ("default", "jnp.matmul"),
        ("default", "a"),
        ("default", "b"),
        ("highest", "jnp.matmul"),
        ("high", "a"),
        ("high", "b"),
        ("high", "c"),
        ("highest", "a"),
    ]
    assert [r.peer_precision for r in rows if r.kernel != "jnp.matmul"] == [
        "default",
        "default",
        "highest",
        "highest",
        "highest",
        "highest",
    ]
    assert harness.count_rows(by_precision) == len(rows)


def test_a_presets_peer_is_jnp_at_the_same_preset(tmp_path, monkeypatch):
    """A preset row times ours and jnp.matmul, each handed the preset itself (not
    a precision standing in for it), and its ratio is to that peer row; HIGH's peer
    stays HIGHEST beside it."""
    preset = "bf16_bf16_f32_x3"
    seen = {"ours": set(), "peer": set()}
    ours, peer = jax_tiled.matmul, jnp.matmul

    def recording(record, mm):
        def wrapped(a, b, *, precision=None, **kwargs):
            seen[record].add(precision)
            return mm(a, b, precision=precision, **kwargs)

        return wrapped

    monkeypatch.setattr(jax_tiled, "matmul", recording("ours", ours))
    monkeypatch.setattr(jnp, "matmul", recording("peer", peer))
    out = tmp_path / "presets.json"
    argv = ["--shapes", "96x64x80", "--dtype", "float32", "--kernels", "auto", "--no-progress"]
    argv += ["--repeats", "5", "--no-pallas", "--precision", f"{preset.upper()},high"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["precision"], r["kernel"]) for r in rows] == [
        (preset, "jnp.matmul"),
        (preset, "auto"),
        ("highest", "jnp.matmul"),
        ("high", "auto"),
    ]
    assert [r["peer_precision"] for r in rows if r["kernel"] == "auto"] == [preset, "highest"]
    assert all(r["error"] is None and r["rel_error"] < 1e-2 for r in rows)
    assert all(r["ratio"] > 0 for r in rows if r["kernel"] == "auto")
    as_preset = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
    assert as_preset in seen["ours"] and as_preset in seen["peer"]
    assert harness.peer_precision(preset) == preset and harness.peer_precision("high") == "highest"


def refused_preset() -> str:
    """A preset jax_tiled refuses on this backend (the float8 ones take float8 operands)."""
    for preset in harness.PRESETS:
        try:
            jax_tiled.kernels(None, "float32", precision=harness.lax_precision(preset))
        except ValueError:
            return preset
    raise AssertionError("every preset is taken here")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--precision", "bf16_bf16_f32_x4"], "unknown precision"),
        (["--precision", "bf16_bf16_f32_x3", "--chain"], "go with the product suite"),
        (["--precision", "bf16_bf16_f32_x3", "--train-step"], "go with the product suite"),
        (["--precision", "REFUSED", "--shapes", "64^3"], "is not supported on"),
    ],
)
def test_a_preset_the_bench_cannot_run_is_an_error_before_the_run(argv, message, capsys):
    argv = [refused_preset() if a == "REFUSED" else a for a in argv]
    with pytest.raises(SystemExit):
        cli.main([*argv, "--no-progress"])
    assert message in capsys.readouterr().err


TINY_ACCURACY = ["--accuracy", "--shapes", "40x48x24", "--no-progress"]


def run_tiny_accuracy(tmp_path, *argv) -> tuple[int, list[dict]]:
    out = tmp_path / "accuracy.json"
    status = cli.main([*TINY_ACCURACY, *argv, "--json", str(out)])
    return status, json.loads(out.read_text())["accuracy"]["rows"]


def test_accuracy_measures_ours_and_the_peer_against_float64(tmp_path, capsys):
    status, rows = run_tiny_accuracy(tmp_path)
    assert status == 0
    groups = {}
    for row in rows:
        key = (row["dtype"], row["out_dtype"], row["precision"], row["inputs"])
        groups.setdefault(key, set()).add(row["kernel"])
    # float32 at every precision; 16-bit at default, into its own dtype and into float32.
    configs = {("float32", "float32", p) for p in harness.PRECISIONS} | {
        (dtype, out, "default") for dtype in ("bfloat16", "float16") for out in (dtype, "float32")
    }
    assert set(groups) == {(*c, inputs) for c in configs for inputs in ("positive", "normal")}
    available = [*jax_tiled.kernels(), "auto"]
    for (dtype, out, precision, _), kernels in groups.items():
        assert kernels == set(harness.kernels_for(dtype, precision, available, False, out))
    # A CUDA kernel may refuse this shape; every other row is measured, on both sides,
    # within a few units of the rounding of its dtype at its precision (TF32 at float32
    # default on a GPU), and |bias| <= err rms(ref) / mean(|ref|) (Cauchy-Schwarz).
    measured = [row for row in rows if not row["refused"]]
    assert measured and all(row["error"] is None for row in measured)
    for row in measured:
        bound = harness.agreement_tolerance(row["out_dtype"], row["precision"])
        # jnp.matmul at HIGH is a TF32 pass on a GPU (XLA's choice): its bound is DEFAULT's.
        peer_bound = harness.agreement_tolerance(
            row["out_dtype"], "default" if row["precision"] == "high" else row["precision"]
        )
        assert 0 <= row["err"] < bound and 0 <= row["peer_err"] < peer_bound, row
        assert abs(row["bias"]) <= 2 * row["err"] and abs(row["peer_bias"]) <= 2 * row["peer_err"]
        assert isinstance(row["misses"], list)
    # The table comes last, every measured row's cells under the header's columns.
    lines = capsys.readouterr().out.splitlines()
    head = max(i for i, line in enumerate(lines) if line.startswith("shape"))
    columns = lines[head].split()
    body = [line.split() for line in lines[head + 2 :]]
    assert len(body) == len(rows)
    body = [cells for cells in body if "ERROR" not in cells]
    assert len(body) == len(measured) and all(len(cells) == len(columns) for cells in body)
    assert {cells[columns.index("flag")] for cells in body} <= {"ok", "ERR", "BIAS", "ERR+BIAS"}


def test_accuracy_of_a_preset_is_against_jnp_at_that_preset(tmp_path):
    preset = "bf16_bf16_f32_x6"
    status, rows = run_tiny_accuracy(tmp_path, "--dtype", "float32", "--precision", preset)
    assert status == 0 and rows
    measured = [row for row in rows if not row["refused"]]
    assert measured and all(row["precision"] == row["peer_precision"] == preset for row in rows)
    for row in measured:
        assert row["error"] is None and 0 <= row["err"] < 1e-3 and 0 <= row["peer_err"] < 1e-3


def test_accuracy_flags_a_kernel_that_misses_the_targets(tmp_path, monkeypatch, capsys):
    """Ours 5% high: its error is far past 1.2x the peer's everywhere, and on positive
    inputs its bias is the 5%."""
    monkeypatch.setattr(jax_tiled, "matmul", WRONG_PRODUCTS["forward"](jax_tiled.matmul))
    status, rows = run_tiny_accuracy(tmp_path, "--dtype", "float32", "--precision", "highest")
    assert status == 0  # flags are findings, not failures
    assert rows and all("err" in row["misses"] and row["err_ratio"] > 1e3 for row in rows)
    positive = [row for row in rows if row["inputs"] == "positive"]
    assert positive and all(row["misses"] == ["err", "bias"] for row in positive)
    assert all(row["bias"] == pytest.approx(0.05, rel=1e-3) for row in positive)
    assert "ERR+BIAS" in capsys.readouterr().out


def test_accuracy_reports_a_refused_kernel_as_a_row(tmp_path, monkeypatch, capsys):
    """A forced kernel that refuses the product (ValueError when traced) is a refused
    row; the other kernels' rows and the exit status are unaffected."""
    right = jax_tiled.matmul

    def refusing(a, b, *, kernel="auto", **kwargs):
        if kernel != "auto":
            raise ValueError(f"kernel {kernel!r} does not compute this product")
        return right(a, b, kernel=kernel, **kwargs)

    monkeypatch.setattr(jax_tiled, "matmul", refusing)
    forced = jax_tiled.kernels()[0]
    status, rows = run_tiny_accuracy(
        tmp_path, "--dtype", "float32", "--precision", "highest", "--kernels", f"{forced},auto"
    )
    assert status == 0
    by_kernel = {kernel: [r for r in rows if r["kernel"] == kernel] for kernel in (forced, "auto")}
    assert all(r["refused"] and r["error"].startswith("refused: ") for r in by_kernel[forced])
    assert all(r["error"] is None and r["err"] is not None for r in by_kernel["auto"])
    assert "ERROR refused: kernel" in capsys.readouterr().out


def test_accuracy_peer_runs_at_the_targets_precision_and_the_rows_output(tmp_path, monkeypatch):
    """3xTF32 is held to HIGHEST's error (docs/performance.md), so a `high` row's
    peer runs at `highest`; the row records it."""
    calls = []

    def recording(shape, precision, kernel, out_dtype=None):
        calls.append((precision, kernel, out_dtype))
        return products.product_fn(shape, precision, kernel, out_dtype)

    monkeypatch.setattr(accuracy, "product_fn", recording)
    _, rows = run_tiny_accuracy(
        tmp_path, "--dtype", "float32,bfloat16", "--precision", "high", "--kernels", "auto"
    )
    assert {c for c in calls if c[1] == harness.PEER} == {
        ("highest", harness.PEER, out) for out in ("float32", "bfloat16")
    }
    assert rows and {(r["precision"], r["peer_precision"]) for r in rows} == {("high", "highest")}


def test_accuracy_definitions_and_targets():
    ref = np.array([[1.0, -2.0], [3.0, 4.0]])
    measured = accuracy.accuracy(ref * 1.01, ref)
    assert measured.err == pytest.approx(0.01)
    assert measured.bias == pytest.approx(0.01 * 6 / 10)  # mean(out - ref) / mean(|ref|)
    # float32 out, 10^6 elements: room of eps/4 = 3.0e-8, and for the bias's chance
    # 3 x 1.2 x 1e-6 / 1000 = 3.6e-9.
    peer, eps_room = accuracy.Accuracy(err=1e-6, bias=1e-8), 2.0**-23 / 4
    allowed = accuracy.limits(peer, "float32", 10**6)
    assert allowed.err == pytest.approx(1.2e-6 + eps_room)
    assert allowed.bias == pytest.approx(2e-8 + eps_room + 3.6e-9)
    ours = accuracy.Accuracy
    assert accuracy.misses(ours(1.2e-6, -5e-8), allowed) == []
    assert accuracy.misses(ours(1.3e-6, 0.0), allowed) == ["err"]
    assert accuracy.misses(ours(1e-6, -6e-8), allowed) == ["bias"]
    nan = float("nan")
    assert accuracy.misses(ours(nan, nan), allowed) == ["err", "bias"]


def test_accuracy_default_shapes_add_a_long_k_for_a_float32_output():
    _, args = cli.parse_args(["--accuracy", "--dtype", "bfloat16"])
    work = accuracy.plan(args, ["auto"], "cpu")
    assert [(shape.name, [p.out_dtype for p in ps]) for shape, _, ps in work] == [
        *((name, ["bfloat16", "float32"]) for name in accuracy.ACCURACY_SHAPES["cpu"]),
        *((name, ["float32"]) for name in accuracy.WIDE_OUTPUT_SHAPES["cpu"]),
    ]


def test_module_entry_point_lists_the_suites():
    """`python -P -m jax_tiled.bench` (the README's command, from any folder)
    runs the package's __main__."""
    result = subprocess.run(
        [sys.executable, "-P", "-m", "jax_tiled.bench", "--list-shapes"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "GPU suite: 512^3" in result.stdout and "CPU --quick: 256^3" in result.stdout
    assert "--user-shapes, M <= 64 (decoding): 16x8192x8192" in result.stdout


def test_user_shapes_cover_each_class_and_replace_the_suite():
    """--user-shapes times the user shape classes, every name parsing, each
    class with shapes the suite does not hold; it is one choice of shapes."""
    _, args = cli.parse_args(["--user-shapes"])
    chosen = [shape.name for shape in cli.default_shapes(args, on_cpu=False)]
    assert chosen == [name for names in shapes.USER_SHAPES.values() for name in names]
    for kind, names in shapes.USER_SHAPES.items():
        assert set(names) - set(shapes.GPU_SUITE), kind
    decoding = [cli.parse_shape(name) for name in shapes.USER_SHAPES["M <= 64 (decoding)"]]
    assert all(shape.m <= 64 for shape in decoding)
    for clash in (["--shapes", "1024^3"], ["--quick"], ["--cpu-suite"], ["--accuracy"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["--user-shapes", *clash])


def test_scaling_tool_runs_on_the_shared_timing(tmp_path):
    """tools/scaling.py times through the bench's timing module; on CPU devices
    (four, from conftest's XLA_FLAGS) at a tiny size it prints a row per layout
    and overlap setting: the milliseconds, the efficiencies, the ratio and the
    all-gathers of ours and of jnp's program; --json writes the same rows."""
    script = Path(__file__).resolve().parent.parent / "tools" / "scaling.py"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the four CPU devices, on a GPU machine too
    report = tmp_path / "scaling.json"
    result = subprocess.run(
        [sys.executable, str(script), "--size", "64", "--repeats", "5", "--no-overlap"]
        + ["--json", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("---"))) + 1 :]
    layouts = (
        "M-sharded",
        "N-sharded",
        "batch-sharded",
        "K-sharded, replicated",
        "K-sharded, reduce-scatter",
        "all-gather (a by M, b by N)",
    )
    variants = ("chunks=auto spare=auto", "no overlap")
    label_end = 28 + 1 + max(20, *map(len, variants))  # the layout's column, a space, the variant's
    assert [
        (line[:28].strip(), line[29:label_end].strip()) for line in table[: 2 * len(layouts)]
    ] == [(layout, label) for layout in layouts for label in variants]
    gathers = {}
    for line in table[: 2 * len(layouts)]:
        ours, theirs, ours_eff, theirs_eff, ratio, gathered = line[label_end:].split()[:6]
        assert float(ours) > 0 and float(theirs) > 0 and ratio.endswith("x")
        assert ours_eff.endswith("%") and theirs_eff.endswith("%")
        gathers[(line[:28].strip(), line[29:label_end].strip())] = tuple(
            int(g) for g in gathered.split("/")
        )
    # The gathered pattern: jnp gathers an operand; the ring sends pieces around instead.
    assert gathers[("all-gather (a by M, b by N)", variants[0])] == (0, 1), gathers
    assert gathers[("M-sharded", "no overlap")] == (0, 0), gathers
    rows = json.loads(report.read_text())["rows"]
    assert [(row["layout"], row["variant"]) for row in rows] == [
        (layout, label) for layout in layouts for label in variants
    ]
    ring = rows[2 * layouts.index("K-sharded, replicated")]
    assert ring["collectives"].get("collective-permute", 0) > 0, ring


def test_scaling_tool_times_under_profile_guided_latency_estimation(tmp_path):
    """--pgle RUNS: each program traced for RUNS calls, then compiled again
    with the profile (empty on CPU devices, so only that it runs and says so);
    --schedule prints the order of each of our programs' collectives and kernels."""
    script = Path(__file__).resolve().parent.parent / "tools" / "scaling.py"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    report = tmp_path / "scaling.json"
    common = [sys.executable, str(script), "--size", "64", "--repeats", "5"]
    layouts = ["M-sharded", "K-sharded, replicated"]
    result = subprocess.run(
        [*common, "--layouts", *layouts, "--pgle", "1", "--schedule", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    written = json.loads(report.read_text())
    assert written["pgle_profiling_runs"] == 1
    assert [row["layout"] for row in written["rows"]] == layouts
    local, ring = written["rows"]
    assert local["schedule"] == ["custom-call"], local  # no communication
    # The ring: a kernel per step, the partial sums passed between them.
    assert ring["schedule"].count("custom-call") == 4, ring
    assert any(op.startswith("collective-permute") for op in ring["schedule"]), ring
    assert ring["pgle_profile_bytes"] == 0 and ring["jnp_pgle_profile_bytes"] == 0
    printed = [line for line in result.stdout.splitlines() if line.startswith("  schedule: ")]
    assert printed == [f"  schedule: {' '.join(row['schedule'])}" for row in written["rows"]]
    refused = subprocess.run(
        [*common, "--pgle", "-1"], capture_output=True, text=True, timeout=300, env=env
    )
    assert refused.returncode == 2 and "--pgle must be at least 0" in refused.stderr


def run_tool(name: str, *args: str):
    """tools/<name> in a process of its own on the four CPU devices (conftest's
    XLA_FLAGS; JAX_PLATFORMS=cpu on a GPU machine too)."""
    script = Path(__file__).resolve().parent.parent / "tools" / name
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def assert_refused(name: str, *args: str, message: str) -> None:
    refused = run_tool(name, *args)
    assert refused.returncode == 2 and message in refused.stderr, refused.stderr[-2000:]


def test_alternate_peers_rotates_the_order_round_by_round(tmp_path):
    """tools/alternate_peers.py times ours and jnp's once a round, the order
    rotated each round, and prints and writes the medians over rounds; a
    Pallas config where the kernel cannot run, and no rounds, are refused."""
    report = tmp_path / "rounds.json"
    common = ("--shape", "64x96x80", "--repeats", "3")
    result = run_tool("alternate_peers.py", *common, "--rounds", "3", "--json", str(report))
    assert result.returncode == 0, result.stderr[-4000:]
    written = json.loads(report.read_text())
    windows = written["windows"]
    assert [(w["round"], w["impl"]) for w in windows] == [
        (0, "ours"), (0, "jnp"), (1, "jnp"), (1, "ours"), (2, "ours"), (2, "jnp"),
    ]  # fmt: skip
    assert all(w["ms"] > 0 and w["start"] <= w["timed_start"] <= w["end"] for w in windows)
    for name in ("ours", "jnp"):
        ms = [w["ms"] for w in windows if w["impl"] == name]
        assert written["medians_ms"][name] == statistics.median(ms)
    assert written["smi_samples"] == []  # no GPU: nothing sampled
    assert f"jnp / ours: {written['medians_ms']['jnp'] / written['medians_ms']['ours']:.3f}x" in (
        result.stdout
    )
    config = "128x128x64.s4.wgN.gN8.cM"
    assert_refused("alternate_peers.py", *common, "--pallas", config, message="unavailable here")
    assert_refused("alternate_peers.py", *common, "--rounds", "0", message="--rounds must be at")


def test_transfer_rates_times_each_transfer_alone(tmp_path):
    """tools/transfer_rates.py on the four CPU devices: a row per ppermute
    (one way, half each way, four pieces) per size, and one psum_scatter,
    each with the bytes a device sends and a positive time; bad sizes refused."""
    report = tmp_path / "rates.json"
    common = ("--size", "64", "--repeats", "3", "--calls", "2")
    result = run_tool(
        "transfer_rates.py", *common, "--mb", "0.0625", "0.125", "--json", str(report)
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads(report.read_text())["rows"]
    hows = ("one way", "half each way", "four pieces one way")
    assert [(r["op"], r["how"], r["bytes"]) for r in rows] == [
        ("ppermute", how, rows_ * 64 * 2) for rows_ in (512, 1024) for how in hows
    ] + [("psum_scatter", "tiled", 3 * 64 * 64 * 2 // 4)]
    assert all(r["us"] > 0 for r in rows)
    assert result.stdout.count(" GB/s") == len(rows)
    assert_refused("transfer_rates.py", *common, "--mb", "0", message="--mb must be positive")
    assert_refused("transfer_rates.py", *common, "--devices", "9", message="--devices must be 2 to")


def test_scaling_tool_times_the_gather_rings(tmp_path):
    """--gather-ring blocks collectives: a row each for the all-gather pattern,
    the ring's program without an all-gather, the collectives' with one a
    piece (jnp's one), neither flagged as gathering where jnp does not."""
    report = tmp_path / "scaling.json"
    result = run_tool(
        "scaling.py", "--size", "64", "--repeats", "3", "--layouts", "all-gather (a by M, b by N)",
        "--gather-ring", "blocks", "collectives", "--json", str(report),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads(report.read_text())["rows"]
    assert [row["variant"].split()[-1] for row in rows] == [
        "gather_ring=blocks",
        "gather_ring=collectives",
    ]
    blocks, pieces = rows
    assert blocks["collectives"] == {"collective-permute": 3}, blocks
    assert pieces["collectives"] == {"all-gather": jax_tiled.overlap.COLLECTIVE_PIECES}, pieces
    assert blocks["jnp_collectives"].get("all-gather") == 1
    assert "GATHERS WHERE JNP DOES NOT" not in result.stdout


def test_scaling_tool_measures_error_against_float64(tmp_path):
    """--accuracy: each row's error and bias against the float64 product of
    its inputs, ours beside jnp's on the same sharding, printed and written,
    with the targets missed; --inputs positive draws them from [0.5, 1.5]."""
    report = tmp_path / "scaling.json"
    layouts = ["M-sharded", "K-sharded, reduce-scatter"]
    result = run_tool(
        "scaling.py", "--size", "64", "--repeats", "3", "--dtype", "bfloat16", "--precision",
        "default", "--layouts", *layouts, "--k-sums", "accumulation", "output", "--inputs",
        "positive", "--accuracy", "--json", str(report),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    written = json.loads(report.read_text())
    assert written["inputs"] == "positive"
    rows = written["rows"]
    assert [(row["layout"], row["variant"].split()[-1]) for row in rows] == [
        (layout, f"sums={sums}") for layout in layouts for sums in ("accumulation", "output")
    ]
    for row in rows:
        # bfloat16 results: within a few roundings (2^-8) of float64, not exact.
        assert 0 < row["err"] < 2**-6 and 0 < row["jnp_err"] < 2**-6, row
        assert abs(row["bias"]) < 2**-6 and row["misses"] == [], row
    # The rows without a ring are one kernel on each device's own rows: what
    # the K split changes, the error of M-sharded rows does not.
    assert rows[0]["err"] == rows[1]["err"], rows[:2]
    printed = [line for line in result.stdout.splitlines() if "  err " in line]
    assert len(printed) == 1 + len(rows)  # the one-device product's too
    assert all("(jnp " in line for line in printed), printed


def test_scaling_tool_profiles_each_program(tmp_path):
    """--profile: each row's program and jnp's traced, their first GPU's
    longest kernels printed under the row and written: here none, as run_tool
    runs the tool on the CPU devices (on a GPU machine too), which have no GPU
    plane. (On GPUs it lists the products and transfers: the H200 runs of
    docs/sharding.md, "Two H200s".)"""
    report = tmp_path / "scaling.json"
    layouts = ["K-sharded, reduce-scatter"]
    result = run_tool(
        "scaling.py", "--size", "64", "--repeats", "3", "--layouts", *layouts, "--profile",
        "--json", str(report),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    (row,) = json.loads(report.read_text())["rows"]
    assert row["kernels_us"] == {} and row["jnp_kernels_us"] == {}, row
    printed = [line for line in result.stdout.splitlines() if "longest kernels" in line]
    assert [line.split(":")[0].strip() for line in printed] == ["ours", "jnp"], printed
    assert all(line.endswith("none traced") for line in printed), printed


def test_scaling_tool_compiles_with_options_and_times_the_ring_settings(tmp_path):
    """--compiler-option NAME=VALUE compiles ours and jnp's programs with that
    XLA option (typed, written to the JSON); --gather-spare-sms,
    --gather-barrier, --k-ring and --k-sums add a row per value of each; a
    malformed option is refused."""
    script = Path(__file__).resolve().parent.parent / "tools" / "scaling.py"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    report = tmp_path / "scaling.json"
    common = [sys.executable, str(script), "--size", "64", "--repeats", "5"]
    option = "xla_gpu_enable_analytical_latency_estimator"
    layouts = ["all-gather (a by M, b by N)", "K-sharded, reduce-scatter"]
    result = subprocess.run(
        [*common, "--layouts", *layouts, "--gather-spare-sms", "auto", "16"]
        + ["--gather-barrier", "on", "off", "--k-ring", "sums", "operands"]
        + ["--k-sums", "accumulation", "output"]
        + ["--compiler-option", f"{option}=true", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"# compiled with {{'{option}': True}}" in result.stdout
    written = json.loads(report.read_text())
    assert written["compiler_options"] == {option: True}
    assert written["permutes_by_copy_engines"] is False  # CPU devices: no such XLA flag here
    variants = [
        f"chunks=auto spare=auto gather={gather} barrier={barrier} {ring} sums={sums}"
        for gather in ("auto", 16)
        for barrier in ("on", "off")
        for ring in ("sums", "operands")
        for sums in ("accumulation", "output")
    ]
    assert [(row["layout"], row["variant"]) for row in written["rows"]] == [
        (layout, variant) for layout in layouts for variant in variants
    ]
    refused = subprocess.run(
        [*common, "--compiler-option", "no-value"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert refused.returncode == 2 and "expected NAME=VALUE, got 'no-value'" in refused.stderr
