"""The benchmark CLI runs end to end on a tiny shape and writes its JSON."""

from __future__ import annotations

import json

from jax_tiled import bench


def test_bench_runs_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--shapes", "96x64x80", "--repeats", "5", "--no-progress",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    kernels = {row["kernel"] for row in result["rows"]}
    assert {"jnp.matmul", "auto"} <= kernels
    assert all(row.get("error") is None for row in result["rows"])
