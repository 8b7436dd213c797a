"""The benchmark's second peer, jax's Pallas Mosaic-GPU Hopper kernel (bench/pallas.py):
its column where it cannot run, its configs, the rows it cannot compute, the sweep's
bookkeeping (on CPU, with jnp.matmul standing in for the kernel) and, on an sm_90
GPU, one row of the real kernel against float64."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tiled.bench import cli, harness, pallas, products
from jax_tiled.bench.shapes import parse_shape

CPU_REASON = pallas.unavailable(jax.devices("cpu")[0])
# `auto` alone: these tests are of the Pallas column, and every kernel's rows
# at every precision took 200-320 s a test on an H100 (2026-11-26).
TINY = ["--repeats", "5", "--no-progress", "--kernels", "auto"]


def area(config: pallas.Config) -> int:
    return config.cluster_tile[0] * config.cluster_tile[1]


LARGEST = max(pallas.CONFIGS, key=area)
SMALLEST = min(pallas.CONFIGS, key=area)


def fitting(config: pallas.Config, scale: int = 1, k_steps: int = 1) -> str:
    """The name of a shape that `config` fits: its cluster tile times `scale`, K of
    k_steps of its tile_k."""
    m, n = config.cluster_tile
    return f"{scale * m}x{k_steps * config.tile_k}x{scale * n}"


def run_bench(tmp_path, *argv) -> tuple[int, dict]:
    out = tmp_path / "bench.json"
    status = cli.main([*TINY, *argv, "--json", str(out)])
    return status, json.loads(out.read_text())


def rows_of(doc: dict, kernel: str) -> list[dict]:
    return [row for row in doc["rows"] if row["kernel"] == kernel]


def table(printed: str) -> tuple[list[str], list[str]]:
    """The product table's columns (each name one word) and its rows' lines."""
    lines = printed.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("shape"))
    columns = lines[head].replace("x peer", "x_peer").replace("x pallas", "x_pallas").split()
    body = []
    for line in lines[head + 2 :]:
        try:
            parse_shape(line.split()[0])
        except (IndexError, ValueError):  # past the rows
            break
        body.append(line)
    return columns, body


@pytest.fixture
def unavailable_as_on_cpu(monkeypatch):
    """The Pallas peer unavailable, as on CPU, whatever device the tests run on."""
    monkeypatch.setattr(pallas, "unavailable", lambda device=None: CPU_REASON)


def test_the_kernel_is_unavailable_on_cpu_with_a_reason():
    assert isinstance(CPU_REASON, str) and "sm_90" in CPU_REASON and "cpu" in CPU_REASON


def test_the_column_is_left_out_where_the_kernel_cannot_run(
    tmp_path, capsys, unavailable_as_on_cpu
):
    status, doc = run_bench(tmp_path, "--shapes", "96x64x80", "--dtype", "bfloat16")
    assert status == 0
    assert doc["pallas"]["enabled"] is False and doc["pallas"]["unavailable"] == CPU_REASON
    assert not rows_of(doc, harness.PALLAS)
    assert all(row["pallas_ratio"] is None for row in doc["rows"])
    printed = capsys.readouterr()
    columns, _ = table(printed.out)
    assert "x_pallas" not in columns and "config" not in columns
    assert f"left out (--pallas shows it, marked n/a): {CPU_REASON}" in printed.err


def test_asked_for_where_it_cannot_run_each_row_says_why(tmp_path, capsys, unavailable_as_on_cpu):
    status, doc = run_bench(
        tmp_path, "--pallas", "--shapes", "96x64x80,64^3", "--dtype", "bfloat16,float32"
    )
    assert status == 0
    assert doc["pallas"]["enabled"] is True
    peers = rows_of(doc, harness.PEER)
    ours = [row for row in doc["rows"] if row["kernel"] not in harness.PEERS]
    pallas_rows = rows_of(doc, harness.PALLAS)
    # One Pallas row beside each jnp.matmul row, each saying why, none an error.
    assert [(r["shape"], r["dtype"], r["precision"]) for r in pallas_rows] == [
        (r["shape"], r["dtype"], r["precision"]) for r in peers
    ]
    for row in pallas_rows:
        assert row["not_applicable"] == f"unavailable: {CPU_REASON}"
        assert row["error"] is None and row["ms"] is None and row["sweep"] is None
    assert ours and all(row["pallas_ratio"] is None and row["ratio"] for row in ours)
    columns, body = table(capsys.readouterr().out)
    assert {"x_pallas", "config"} <= set(columns)
    assert len(body) == len(doc["rows"])
    for line in body:
        cells = line.split()
        if cells[3] == harness.PALLAS:
            assert line.split(None, 5)[5] == f"n/a unavailable: {CPU_REASON}"
        else:
            assert len(cells) == len(columns), line
            assert cells[columns.index("x_pallas")] == (
                "peer" if cells[3] in harness.PEERS else "-"
            )


@pytest.mark.parametrize("mode", ["--train-step", "--chain", "--accuracy"])
@pytest.mark.parametrize("flag", ["--pallas", "--no-pallas"])
def test_the_pallas_flags_go_with_the_product_suite(mode, flag):
    with pytest.raises(SystemExit):
        cli.parse_args([mode, flag])


def test_the_configs_are_well_formed():
    assert 1 <= len(pallas.CONFIGS) <= 6
    names = [config.name for config in pallas.CONFIGS]
    assert len(set(names)) == len(names)
    assert all(name and not any(ch.isspace() for ch in name) for name in names)
    itemsize = min(np.dtype(jnp.dtype(d)).itemsize for d in pallas.DTYPES)
    for config in pallas.CONFIGS:
        assert config.wg_dimension in ("M", "N") and config.grid_minor_dim in ("M", "N")
        assert config.cluster_dimension in (None, "M", "N")
        assert config.grid_tile_width >= 1 and config.max_concurrent_steps >= 2
        # The epilogue's 64 x 64 tiles divide the warpgroup's tile, and a row of the
        # operand tiles spans the 128-byte swizzle.
        assert config.tile_m % 64 == 0 and config.tile_n % 64 == 0
        assert (config.tile_k * itemsize) % 128 == 0
        assert config.smem_bytes(itemsize) <= pallas.SMEM_BYTES, config.name
        block_m, block_n = config.block_tile
        cluster_m, cluster_n = config.cluster_tile
        assert block_m * block_n == 2 * config.tile_m * config.tile_n
        assert cluster_m % block_m == 0 and cluster_n % block_n == 0
        assert config.misfit(cluster_m, config.tile_k, cluster_n) is None


@pytest.fixture
def module(monkeypatch):
    """The kernel's module, where this jax has it; its SM count fixed, so that it
    traces on any device (it only divides the persistent grid by it)."""
    try:
        module = importlib.import_module(pallas.MODULE)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"{pallas.MODULE} does not import: {exc}")
    monkeypatch.setattr(module, "get_num_sms", lambda: 132)
    return module


def test_the_configs_are_the_modules(module):
    """Each config maps onto the module's TuningConfig, field for field."""
    fields = {f.name for f in dataclasses.fields(module.TuningConfig)}
    for config in pallas.CONFIGS:
        assert {f.name for f in dataclasses.fields(config)} <= fields
        tuning = pallas.tuning_config(module, config)
        for field in dataclasses.fields(config):
            value = getattr(tuning, field.name)
            assert str(value) == str(getattr(config, field.name)), (config.name, field.name)


# Each config's own cluster tile (which the configs of larger tiles do not fit), and
# one K that is no multiple of a tile_k.
TRACED = sorted({fitting(c) for c in pallas.CONFIGS}) + [
    f"{LARGEST.cluster_tile[0]}x{3 * LARGEST.tile_k // 2}x{LARGEST.cluster_tile[1]}"
]


@pytest.mark.parametrize("name", TRACED)
def test_a_config_fits_a_shape_where_the_module_traces_it(module, name):
    """misfit() says what the module's own checks say: the kernel traces (on any
    device) exactly where a config fits, and refuses the rest with a ValueError."""
    shape = parse_shape(name)
    m, k, n = shape.m, shape.k, shape.n
    for config in pallas.CONFIGS:
        product = lambda: jax.eval_shape(
            pallas.matmul_fn(config),
            jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((k, n), jnp.bfloat16),
        )
        if config.misfit(m, k, n) is None:
            assert product().shape == (m, n), config.name
        else:
            with pytest.raises(ValueError, match="divisible"):
                product()


def test_rows_it_cannot_compute_say_why():
    reason = lambda name, dtype="bfloat16", precision="default": pallas.not_applicable(
        parse_shape(name), dtype, precision
    )
    fits = fitting(LARGEST)
    for dtype in pallas.DTYPES:
        assert reason(fits, dtype) is None
    assert "float32" in reason(fits, "float32")
    assert "transposed" in reason(f"{fits}-tA") and "transposed" in reason(f"{fits}-tB")
    assert "batched" in reason(f"b2x{fits}")
    assert "default" in reason(fits, precision="highest")
    # A shape that no config's tiles divide.
    m, n = LARGEST.cluster_tile
    assert all(config.misfit(m + 1, LARGEST.tile_k, n) for config in pallas.CONFIGS)
    assert reason(f"{m + 1}x{LARGEST.tile_k}x{n}").startswith("no config divides it")


def _stand_in(fail: set[str]):
    """matmul_fn with jnp.matmul for the kernel, the configs in `fail` refusing."""

    def matmul_fn(config):
        if config.name in fail:

            def refuse(a, b):
                raise ValueError(f"{config.name} exceeds available shared memory")

            return refuse
        return jnp.matmul

    return matmul_fn


def test_the_sweep_reports_the_fastest_config(tmp_path, capsys, monkeypatch):
    """On CPU, jnp.matmul stands in for the kernel: the sweep times each config that
    fits through the harness, records the one that refuses and the ones that do not
    fit, and the row reports the fastest, timed once more (not its sweep time, the
    fastest of many); our rows get their ratio to it."""
    refused = pallas.CONFIGS[0].name
    monkeypatch.setattr(pallas, "unavailable", lambda device=None: None)
    monkeypatch.setattr(pallas, "matmul_fn", _stand_in({refused}))
    big, small = fitting(LARGEST), fitting(SMALLEST)
    status, doc = run_bench(
        tmp_path, "--shapes", f"{big},{small},{big}-tB", "--dtype", "bfloat16,float32"
    )
    assert status == 0
    assert doc["pallas"]["enabled"] is True and doc["pallas"]["unavailable"] is None
    assert [c["name"] for c in doc["pallas"]["configs"]] == [c.name for c in pallas.CONFIGS]
    by_key = {(r["shape"], r["dtype"], r["kernel"]): r for r in doc["rows"]}
    for shape in (big, small):
        row = by_key[shape, "bfloat16", harness.PALLAS]
        assert row["error"] is None and row["not_applicable"] is None
        entries = {entry["config"]: entry for entry in row["sweep"]}
        assert list(entries) == [c.name for c in pallas.CONFIGS]
        timed = {name: e for name, e in entries.items() if e["ms"] is not None}
        for config in pallas.CONFIGS:
            entry = entries[config.name]
            dims = parse_shape(shape)
            misfit = config.misfit(dims.m, dims.k, dims.n)
            assert entry["not_applicable"] == misfit
            assert (entry["error"] is not None) == (misfit is None and config.name == refused)
            assert (config.name in timed) == (misfit is None and config.name != refused)
        assert timed and len(timed) < len(entries)
        best = min(timed.values(), key=lambda e: e["ms"])
        assert row["config"] == best["config"]
        assert row["samples_ms"] != best["samples_ms"]  # its own timing, after the sweep
        assert len(row["samples_ms"]) == len(best["samples_ms"]) == doc["repeats"]
        assert row["ms"] == pytest.approx(statistics.median(row["samples_ms"]))
        assert row["tflops"] == pytest.approx(dims.flops / row["ms"] / 1e9)
        assert row["rel_error"] is not None
        ours = by_key[shape, "bfloat16", "auto"]
        assert ours["pallas_ms"] == row["ms"]
        assert ours["pallas_ratio"] == pytest.approx(row["ms"] / ours["ms"])
    assert "transposed" in by_key[f"{big}-tB", "bfloat16", harness.PALLAS]["not_applicable"]
    for shape in (big, small):
        assert "float32" in by_key[shape, "float32", harness.PALLAS]["not_applicable"]
        assert by_key[shape, "float32", "auto"]["pallas_ratio"] is None
    summary = {(g["dtype"], g["kernel"]): g for g in doc["geomeans"]}
    assert summary["bfloat16", "auto"]["pallas"]["n"] == 2
    assert summary["float32", "auto"]["pallas"] is None
    # The JSON's rows are products.Row, the sweep's entries pallas.SweepEntry.
    assert all(set(r) == {f.name for f in dataclasses.fields(products.Row)} for r in doc["rows"])
    entry_fields = {f.name for f in dataclasses.fields(pallas.SweepEntry)}
    assert all(set(e) == entry_fields for r in doc["rows"] for e in r["sweep"] or ())
    # The table names the winning config on the Pallas row; the summary, our ratios to it.
    printed = capsys.readouterr().out
    columns, body = table(printed)
    winners = {
        cells[0]: cells[columns.index("config")]
        for cells in map(str.split, body)
        if cells[1:4] == ["bfloat16", "default", harness.PALLAS] and len(cells) == len(columns)
    }
    assert winners == {
        shape: by_key[shape, "bfloat16", harness.PALLAS]["config"] for shape in (big, small)
    }
    assert "vs pallas" in printed.split("geometric mean")[1]


def test_a_row_whose_every_config_fails_is_an_error_row(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pallas, "unavailable", lambda device=None: None)
    monkeypatch.setattr(pallas, "matmul_fn", _stand_in({c.name for c in pallas.CONFIGS}))
    status, doc = run_bench(tmp_path, "--shapes", fitting(LARGEST), "--dtype", "bfloat16")
    assert status == 0  # the other rows were measured
    (row,) = rows_of(doc, harness.PALLAS)
    assert row["error"].startswith("every config failed; ") and row["ms"] is None
    ours = rows_of(doc, "auto")
    assert ours and all(r["pallas_ratio"] is None and r["ratio"] for r in ours)
    assert "ERROR every config failed; " in capsys.readouterr().out


@pytest.mark.gpu
def test_the_kernel_on_an_sm90_gpu_agrees_with_float64(tmp_path, on_gpu, rng):
    """On an sm_90 GPU the module must import and run: a bfloat16 row's sweep times
    every config that fits, the fastest is timed again and reported, and its product
    is as close to the float64 product as jnp.matmul's."""
    reason = pallas.unavailable()
    if reason and "compute capability" in reason:
        pytest.skip(reason)
    assert reason is None
    # Every config fits it: twice the largest cluster tile (whose sides are multiples
    # of the others'), and K of a few steps.
    shape = fitting(LARGEST, scale=2, k_steps=4)
    m, k, n = (getattr(parse_shape(shape), dim) for dim in "mkn")
    assert all(config.misfit(m, k, n) is None for config in pallas.CONFIGS)
    status, doc = run_bench(tmp_path, "--pallas", "--shapes", shape, "--dtype", "bfloat16")
    assert status == 0
    (row,) = rows_of(doc, harness.PALLAS)
    (peer,) = rows_of(doc, harness.PEER)
    assert row["error"] is None and row["not_applicable"] is None, row
    assert all(e["error"] is None and e["ms"] > 0 for e in row["sweep"]), row["sweep"]
    assert row["config"] in {c.name for c in pallas.CONFIGS}
    # The sweep's fastest config, timed once more after the sweep (sweep_into).
    assert row["config"] == min(row["sweep"], key=lambda e: e["ms"])["config"]
    assert row["ms"] > 0 and row["tflops"] > 0
    tolerance = harness.agreement_tolerance("bfloat16", "default")
    allowed = max(tolerance, harness.PEER_ERR_FACTOR * peer["rel_error"])
    assert row["rel_error"] <= allowed
    (ours,) = rows_of(doc, "auto")
    assert math.isfinite(ours["pallas_ratio"]) and ours["pallas_ratio"] > 0
    # The winning config's product itself, against float64 NumPy.
    winner = next(c for c in pallas.CONFIGS if c.name == row["config"])
    a = rng.standard_normal((m, k)).astype(jnp.bfloat16)
    b = rng.standard_normal((k, n)).astype(jnp.bfloat16)
    truth = a.astype(np.float64) @ b.astype(np.float64)
    out = pallas.matmul_fn(winner)(jnp.asarray(a), jnp.asarray(b))
    assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
    reference = jnp.matmul(jnp.asarray(a), jnp.asarray(b))
    peer_err = harness.relative_distance(reference, truth)
    assert harness.relative_distance(out, truth) <= max(
        tolerance, harness.PEER_ERR_FACTOR * peer_err
    )
