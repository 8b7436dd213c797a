"""The ladder report (`python -m jax_tiled.bench --ladder`): its arguments, the
bytes each rung reads per output by its tiling, the Nsight Compute output it
reads, its rows and tables end to end (on the CPU kernel standing in for the
rungs), and on a GPU the report itself."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil

import jax
import jax.numpy as jnp
import pytest

from helpers import CUDA_TABLE, gpu_available
from jax_tiled import _ffi
from jax_tiled.bench import cli, ladder, pallas, report
from jax_tiled.bench.harness import PEER
from jax_tiled.bench.timing import CPU_BUDGET

# ---- Arguments ----


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--ladder", "--shapes", "1024^3,2048^3"],
            "--ladder times one shape, got 2: 1024^3, 2048^3",
        ),
        (
            ["--ladder", "--shapes", "1024^3", "--shapes", "512^3"],
            "--ladder times one shape, got 2",
        ),
        (["--ladder", "--precision", "high,highest"], "--ladder runs every rung at one precision"),
        (["--ladder", "--quick"], "--ladder times one shape: --quick"),
        (["--ladder", "--list-shapes"], "--ladder times one shape"),
        (["--ladder", "--train-step"], "--train-step and --ladder are separate runs"),
        (["--ladder", "--accuracy"], "--accuracy and --ladder are separate runs"),
        (["--ladder", "--pallas"], "--pallas and --no-pallas go with the product suite"),
        (["--ladder-md", "out.md"], "--ladder-md and --ncu go with --ladder"),
        (["--ncu"], "--ladder-md and --ncu go with --ladder"),
        (["--ladder", "--shapes", "4096"], "bad shape '4096'"),
    ],
)
def test_ladder_arguments_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.parse_args(argv)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_ladder_defaults_and_choices():
    _, args = cli.parse_args(["--ladder"])
    assert args.ladder and args.shapes is None and args.precision is None and not args.ncu
    assert args.dtype == list(ladder.DEFAULT_DTYPES) == ["float32", "bfloat16"]
    _, args = cli.parse_args(
        [
            "--ladder",
            "--shapes",
            "b2x64x32x48",
            "--precision",
            "high",
            "--dtype",
            "float16",
            "--ncu",
        ]
    )
    (shape,) = args.shapes
    assert (shape.batch, shape.m, shape.k, shape.n) == (2, 64, 32, 48)
    assert args.precision == "high" and args.dtype == ["float16"] and args.ncu


@pytest.mark.skipif(gpu_available(), reason="a GPU runs the report (test_the_report_on_a_gpu)")
def test_the_ladder_is_a_gpu_report(capsys):
    """On CPU --ladder exits at once with a usage error that says why."""
    with pytest.raises(SystemExit) as exit:
        cli.main(["--ladder", "--no-progress"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "--ladder reports the CUDA kernel ladder and needs a GPU" in err
    assert "default backend is cpu" in err


# ---- Bytes per output, by the tiling ----


def test_bytes_per_output_by_the_tiling():
    k = 4096
    # naive: one thread per output reads its row of A and column of B.
    assert ladder.bytes_per_output(k, 4, 1, 1) == 2 * k * 4
    # A block_m x block_n tile: K / block_n of A and K / block_m of B per output.
    assert ladder.bytes_per_output(k, 4, 32, 32) == 2 * k * 4 / 32
    assert ladder.bytes_per_output(k, 2, 128, 256) == k * 2 * (1 / 256 + 1 / 128)
    assert ladder.bytes_per_output(k, 2, 128, 256) == ladder.bytes_per_output(k, 2, 256, 128)
    # Two blocks of a cluster share each B tile: B is read once for 256 rows.
    assert ladder.bytes_per_output(k, 2, 128, 256, cluster_m=2) == k * 2 * (2 / 256)
    # Wider tiles read less: each rung of the SIMT ladder halves it.
    widths = (1, 16, 32, 64, 128)
    reads = [ladder.bytes_per_output(k, 4, w, w) for w in widths]
    assert reads == sorted(reads, reverse=True) and reads[-1] == 256


# ---- Nsight Compute's output ----

# What `ncu --metrics lts__t_sectors_op_read.sum,dram__bytes_read.sum --csv
# --print-units base --profile-from-start off --clock-control none python3 -P -m
# jax_tiled.bench.ladder --probe naive 512^3 float32 highest` printed on an H100
# (Nsight Compute of the CUDA 13.0 image, 2026-11-24): its log lines, then one
# row per launch and metric, values with thousands separators.
NCU_SAMPLE = """\
==WARNING== Note: Running with unmodified GPU clocks. If not controlled otherwise, profiling \
results may be inconsistent.
==PROF== Connected to process 1422 (/usr/bin/python3.12)
==PROF== Disconnected from process 1422
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",\
"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1422","python3.12","127.0.0.1","void NaiveMatmul<float, float, float>(MatmulDims, const \
T1 *, const T1 *, T2 *)","1","14","(16, 16, 1)","(32, 32, 1)","0","9.0","Command line profiler \
metrics","dram__bytes_read.sum","byte","2,109,952"
"0","1422","python3.12","127.0.0.1","void NaiveMatmul<float, float, float>(MatmulDims, const \
T1 *, const T1 *, T2 *)","1","14","(16, 16, 1)","(32, 32, 1)","0","9.0","Command line profiler \
metrics","lts__t_sectors_op_read.sum","sector","1,370,158"
"""


def test_ncu_csv_of_one_launch():
    reading = ladder.parse_ncu_csv(NCU_SAMPLE)
    assert reading.kernels == (
        "void NaiveMatmul<float, float, float>(MatmulDims, const T1 *, const T1 *, T2 *)",
    )
    assert reading.l2_read_bytes == 1_370_158 * ladder.SECTOR_BYTES
    assert reading.dram_read_bytes == 2_109_952


def test_ncu_csv_is_summed_over_the_products_launches():
    """A product of two kernels (a second launch, ID 1, in scaled units), and
    the program's own output before the table."""
    rows = NCU_SAMPLE.splitlines()[-2:]
    second = [
        row.replace('"0","1422"', '"1","1422"')
        .replace('"byte","2,109,952"', '"Mbyte","1.5"')
        .replace('"sector","1,370,158"', '"sector","10"')
        for row in rows
    ]
    text = "some output of the program\n" + NCU_SAMPLE + "\n".join(second) + "\n"
    reading = ladder.parse_ncu_csv(text)
    assert len(reading.kernels) == 2
    assert reading.l2_read_bytes == (1_370_158 + 10) * ladder.SECTOR_BYTES
    assert reading.dram_read_bytes == 2_109_952 + 1.5e6


def test_ncu_output_without_a_table_or_a_metric():
    with pytest.raises(ValueError, match="no ncu table.*ERR_NVGPUCTRPERM"):
        ladder.parse_ncu_csv(
            "==PROF== Connected to process 1\n==ERROR== ERR_NVGPUCTRPERM - no access\n"
        )
    only_dram = "\n".join(
        line for line in NCU_SAMPLE.splitlines() if "lts__t_sectors_op_read" not in line
    )
    with pytest.raises(ValueError, match="no lts__t_sectors_op_read.sum"):
        ladder.parse_ncu_csv(only_dram)
    with pytest.raises(ValueError, match="unknown unit"):
        ladder.parse_ncu_csv(NCU_SAMPLE.replace('"sector",', '"warp",'))


def test_ncu_profiles_one_product_in_the_hidden_entry_point():
    row = ladder.LadderRow("4096^3", "bfloat16", "default", "wgmma", 6)
    command = ladder.ncu_command("/usr/bin/ncu", row)
    assert command[:2] == ["/usr/bin/ncu", "--metrics"]
    assert command[2] == "lts__t_sectors_op_read.sum,dram__bytes_read.sum"
    assert {"--csv", "--profile-from-start", "off", "--clock-control", "none"} <= set(command)
    assert command[-7:] == [
        "-m",
        "jax_tiled.bench.ladder",
        "--probe",
        "wgmma",
        "4096^3",
        "bfloat16",
        "default",
    ]


def test_the_probe_takes_a_pallas_config_by_name(capsys):
    """`--probe pallas:NAME` (tools/ncu_products.py --pallas) runs a config of the
    benchmark's Pallas sweep; a name of none, or a config that cannot compute the
    product, is refused before anything is computed, the reason named."""
    config = pallas.CONFIGS[0]
    shape = cli.parse_shape("4096^3")
    assert pallas.probed_config(f"pallas:{config.name}", shape, "bfloat16", "default") is config
    with pytest.raises(SystemExit):
        ladder.probe_main(["--probe", "pallas:128x128", "4096^3", "bfloat16", "default"])
    assert "no Pallas config '128x128'; the sweep's: " + config.name in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ladder.probe_main(["--probe", f"pallas:{config.name}", "4096x4096x4224", "bfloat16",
                           "default"])  # fmt: skip
    assert f"cannot compute 4096x4096x4224: N=4224 is no multiple of {config.cluster_tile[1]}" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        ladder.probe_main(["--probe", f"pallas:{config.name}", "4096^3", "float32", "default"])
    assert "takes bfloat16 and float16, not float32" in capsys.readouterr().err


def test_without_ncu_the_measured_columns_say_so(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    row = ladder.LadderRow("64^3", "float32", "highest", "naive", 0, tflops=1.0)
    note = ladder.measure_bytes([row], cli.parse_shape("64^3"), progress_enabled=False)
    assert note == "Measured bytes: ncu (Nsight Compute) was not found on PATH, so none"
    assert row.l2_bytes_per_output is None and row.dram_bytes_per_output is None


# ---- The rows and the tables, on stand-in rungs ----

STAND_IN = ["--ladder", "--shapes", "64x48x32", "--dtype", "float32", "--repeats", "5"]


def stand_in_rungs(monkeypatch):
    """Three rungs that are the CPU kernel (rungs 0, 1 and 2, the last refusing
    the product), with plans of 1 x 1 and 32 x 32 tiles."""
    (blocked,) = _ffi.kernel_table("cpu")
    rungs = [dataclasses.replace(blocked, rung=rung) for rung in (0, 1, 2)]
    refusals = iter(["", "", "kernel 'blocked' stands in for a refusing rung"])
    plans = iter(
        [
            _ffi.CudaPlan("one thread per output", 1, 1, 0, 1, 1, 1, False, 0, False, False),
            _ffi.CudaPlan("32 x 32 tiles", 32, 32, 0, 1, 1, 1, False, 0, False, False),
        ]
    )
    monkeypatch.setattr(ladder, "ladder_rungs", lambda parser, requested: rungs)
    monkeypatch.setattr(ladder, "cuda_refusal", lambda *args: next(refusals))
    monkeypatch.setattr(ladder, "cuda_plan", lambda *args: next(plans))
    monkeypatch.setattr(_ffi, "cuda_module_built", lambda: True)


def test_rows_speedups_and_tables_on_stand_in_rungs(tmp_path, monkeypatch, capsys):
    stand_in_rungs(monkeypatch)
    paths = {
        flag: tmp_path / name for flag, name in (("--json", "l.json"), ("--ladder-md", "l.md"))
    }
    if importlib.util.find_spec("matplotlib"):
        paths["--plot"] = tmp_path / "l.png"
    parser, args = cli.parse_args(
        [
            *STAND_IN,
            "--no-progress",
            *(x for flag, path in paths.items() for x in (flag, str(path))),
        ]
    )
    info = report.device_info()
    with jax.default_device(jax.devices("cpu")[0]):  # where the stand-in runs
        assert cli.ladder_main(parser, args, False, CPU_BUDGET, info) == 0

    rows = json.loads(paths["--json"].read_text())["rows"]
    # Every stand-in gives true fp32: float32 at HIGHEST, the peer at HIGHEST too.
    assert [(r["rung"], r["kernel"], r["precision"]) for r in rows] == [
        (0, "blocked", "highest"),
        (1, "blocked", "highest"),
        (2, "blocked", "highest"),
        (None, PEER, "highest"),
    ]
    naive, tiled, refused, peer = rows
    assert naive["tflops"] > 0 and tiled["tflops"] > 0 and peer["tflops"] > 0
    assert refused["skipped"] and refused["tflops"] is None and refused["bytes_per_output"] is None
    assert naive["step"] is None and naive["vs_naive"] == 1.0
    assert tiled["step"] == pytest.approx(tiled["tflops"] / naive["tflops"])
    assert tiled["vs_naive"] == tiled["step"]
    for row in (naive, tiled):
        assert row["ratio"] == pytest.approx(peer["ms"] / row["ms"])
        assert row["peer_precision"] == "highest"
    assert naive["bytes_per_output"] == 2 * 48 * 4  # K = 48, float32
    assert tiled["bytes_per_output"] == 48 * 4 * 2 / 32
    assert (tiled["block_m"], tiled["block_n"], tiled["plan"]) == (32, 32, "32 x 32 tiles")

    # The markdown: printed and written, a table whose rows fill its columns, and
    # the refusal said under it.
    text = paths["--ladder-md"].read_text()
    assert text in capsys.readouterr().out
    lines = text.splitlines()
    head = lines.index("| " + " | ".join(report.LADDER_COLUMNS) + " |")
    body = lines[head + 2 : head + 6]
    assert [line.split(" | ")[1] for line in body] == ["`blocked`"] * 3 + [f"`{PEER}`"]
    assert all(line.count("|") == len(report.LADDER_COLUMNS) + 1 for line in body)
    assert body[2].split(" | ")[3] == "skipped" and body[3].startswith("| peer |")
    assert "- `blocked` (highest): skipped: kernel 'blocked' stands in for a refusing rung" in text
    assert "Measured bytes: not measured (--ncu" in text and ladder.BYTES_TEXT in text
    assert "--plot" not in paths or paths["--plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_rung_runs_at_the_precision_it_was_built_for():
    """float32 at HIGHEST on the rungs that give true fp32, at DEFAULT (one TF32
    pass) on the others; 16-bit inputs at DEFAULT; --precision overrides."""
    facts = [
        ladder_facts("simt", True, 0),
        ladder_facts("tensor", False, 5),
    ]
    assert [ladder.kernel_precision(k, "float32", None) for k in facts] == ["highest", "default"]
    assert [ladder.kernel_precision(k, "bfloat16", None) for k in facts] == ["default"] * 2
    assert [ladder.kernel_precision(k, "float32", "high") for k in facts] == ["high"] * 2


def ladder_facts(name: str, true_fp32: bool, rung: int) -> _ffi.KernelFacts:
    return _ffi.KernelFacts(
        name=name,
        listed=True,
        tensor_cores=not true_fp32,
        true_fp32=true_fp32,
        min_capability=0,
        hopper_only=False,
        stack_slices=False,
        reads_transposes=False,
        inputs=("float32",),
        outputs=("float32",),
        rung=rung,
    )


def test_speedups_skip_what_was_not_timed():
    rows = [
        ladder.LadderRow("s", "float32", "highest", "a", 0, tflops=2.0),
        ladder.LadderRow("s", "float32", "highest", "b", 1, skipped="refused"),
        ladder.LadderRow("s", "float32", "highest", "c", 2, tflops=8.0),
        ladder.LadderRow("s", "float32", "highest", "d", 3, tflops=4.0, error="failed"),
        ladder.LadderRow("s", "float32", "default", "e", 4, tflops=32.0),
    ]
    ladder.attach_speedups(rows)
    assert [(r.step, r.vs_naive) for r in rows] == [
        (None, 1.0),
        (None, None),
        (4.0, 4.0),
        (None, None),
        (4.0, 16.0),
    ]


# ---- On a GPU ----


@pytest.mark.gpu
def test_the_report_on_a_gpu(tmp_path, capsys):
    """Every listed rung in ladder order per dtype, each timed or refused as its
    refusal says, at the precision it was built for, the naive rung reading 2 K
    per output and smem's width chosen at run time; jnp.matmul at each precision."""
    out, md = tmp_path / "ladder.json", tmp_path / "ladder.md"
    argv = ["--ladder", "--shapes", "256x128x192", "--repeats", "5", "--no-progress"]
    assert cli.main([*argv, "--json", str(out), "--ladder-md", str(md)]) == 0
    doc = json.loads(out.read_text())
    assert doc["ladder"]["shape"] == "256x128x192"
    rows = doc["rows"]
    problem = (1, 1, 256, 192, 128, False, False)
    for dtype in ("float32", "bfloat16"):
        section = [r for r in rows if r["dtype"] == dtype and r["kernel"] != PEER]
        assert [(r["kernel"], r["rung"]) for r in section] == [(k.name, k.rung) for k in CUDA_TABLE]
        for row, kernel in zip(section, CUDA_TABLE):
            precision = "highest" if dtype == "float32" and kernel.true_fp32 else "default"
            assert row["precision"] == precision, row
            why = _ffi.refusal("cuda", kernel.name, dtype, dtype, problem, precision)
            assert (row["skipped"] or "") == why, row
            if not why:
                assert row["error"] is None and row["tflops"] > 0 and row["ratio"] > 0, row
                assert row["bytes_per_output"] > 0, row
        naive = section[0]
        assert naive["kernel"] == "naive" and naive["rung"] == 0 and naive["vs_naive"] == 1.0
        assert naive["bytes_per_output"] == 2 * 128 * jnp.dtype(dtype).itemsize
        smem = next(r for r in section if r["kernel"] == "smem")
        assert "chosen at run time" in smem["plan"], smem
        peers = {r["precision"] for r in rows if r["dtype"] == dtype and r["kernel"] == PEER}
        assert peers == ({"highest", "default"} if dtype == "float32" else {"default"})
    assert md.read_text() in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("ncu") is None, reason="Nsight Compute (ncu) is not on PATH")
def test_ncu_measures_a_rung(on_gpu):
    """One product under ncu in the hidden entry point: the naive rung's reads
    from DRAM (caches flushed, ncu's default) are at most what its threads ask
    for, 2 K elements per output, and come through L2."""
    shape = cli.parse_shape("256^3")
    row = ladder.LadderRow(shape.name, "float32", "highest", "naive", 0, tflops=1.0)
    note = ladder.measure_bytes([row], shape, progress_enabled=False)
    assert note.startswith("Measured bytes: Nsight Compute"), note
    assert row.ncu_error is None, row.ncu_error
    assert 0 < row.dram_bytes_per_output <= ladder.bytes_per_output(256, 4, 1, 1), row
    assert row.l2_bytes_per_output >= row.dram_bytes_per_output, row
