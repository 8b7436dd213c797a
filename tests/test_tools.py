"""tools/compare_baseline.py: rows that lost against the peer since the baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "compare_baseline.py"


def bench_json(path: Path, device: str, ratios: dict) -> Path:
    """A bench --json file with one kernel row per (shape, ratio) and its peer row."""
    rows = []
    for shape, ratio in ratios.items():
        common = {"shape": shape, "dtype": "bfloat16", "precision": "default"}
        rows.append({**common, "kernel": "jnp.matmul", "ratio": None})
        rows.append({**common, "kernel": "auto", "ratio": ratio})
    path.write_text(json.dumps({"device": device, "rows": rows}))
    return path


def compare(baseline: Path, run: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(baseline), str(run)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_flags_exactly_the_rows_that_lost_more_than_three_percent(tmp_path):
    base = bench_json(tmp_path / "base.json", "GPU", {"a": 1.0, "b": 1.0, "c": 0.5, "d": 0.9})
    run = bench_json(tmp_path / "run.json", "GPU", {"a": 0.98, "b": 0.95, "c": 0.6, "e": 1.0})
    result = compare(base, run)
    assert result.returncode == 1, result.stderr
    flagged = [line.split()[0] for line in result.stdout.splitlines() if "REGRESSION" in line]
    assert flagged == ["b"]
    assert "d bfloat16 default auto: only in the baseline" in result.stdout
    assert "e bfloat16 default auto: new" in result.stdout


def test_no_loss_exits_zero(tmp_path):
    base = bench_json(tmp_path / "base.json", "GPU", {"a": 0.9})
    run = bench_json(tmp_path / "run.json", "GPU", {"a": 0.89})
    assert compare(base, run).returncode == 0


def test_refuses_runs_on_different_devices(tmp_path):
    base = bench_json(tmp_path / "base.json", "H100", {"a": 0.9})
    run = bench_json(tmp_path / "run.json", "H200", {"a": 0.9})
    result = compare(base, run)
    assert result.returncode == 2 and "different devices" in result.stderr
