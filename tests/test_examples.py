"""The examples run (on CPU, in seconds, with few steps) and reach their results;
the README's test command is what CI runs and installs the `test` extra's packages."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run(tmp_path, name: str, *args: str) -> dict:
    # In a scratch folder, so that nothing an example writes lands in the repository.
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_mlp_digits_trains_to_the_stock_layers_accuracy(tmp_path):
    result = run(tmp_path, "mlp_digits.py", "--steps", "200")
    assert result["steps"] == 200
    assert result["tiled"]["accuracy"] >= 0.9, result
    assert abs(result["tiled"]["accuracy"] - result["stock"]["accuracy"]) <= 0.01, result


def test_transformer_block_routed_through_tiled(tmp_path):
    result = run(tmp_path, "transformer_tiled.py", "--steps", "150")
    tiled, stock = result["tiled"], result["stock"]
    assert tiled["float_dot_generals_in_step"] == 0 and tiled["tiled_matmuls_in_step"] > 0
    assert stock["float_dot_generals_in_step"] > 0  # the count does see products
    assert tiled["final_loss"] < 0.25 * tiled["first_loss"], result
    assert abs(tiled["final_loss"] - stock["final_loss"]) <= 0.02 * stock["first_loss"], result


def test_export_round_trip(tmp_path):
    result = run(tmp_path, "export_roundtrip.py", "--steps", "50")
    assert result["batches"] == [5, 64]
    assert result["final_loss"] < result["first_loss"]
    assert result["max_difference"] <= 1e-6, result


def test_readme_test_command_is_ci_and_installs_the_test_extra():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Test\n", 1)[1]
    command = re.search(r"```bash\n(.*?)\n```", section, re.S).group(1).strip()
    assert command in (ROOT / ".ci" / "run").read_text()
    installed = set(command.split("&&")[0].split()[2:])
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["test"]
    assert installed == {re.split(r"[<>=!~ ]", req)[0] for req in extra}
