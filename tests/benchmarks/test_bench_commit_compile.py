"""benchmarks/bench_commit_compile.py on CPU (interpret mode, tiny dims): each layers-per-launch
value runs in its own process, commits every layer equal to the jnp reference, and the JSON
records the launches and the environment."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks import bench_commit_compile  # noqa: E402


def test_commit_compile_bench_dry_run(tmp_path):
    rc = bench_commit_compile.main(
        ["--out", str(tmp_path), "--cpu-dry-run", "--per", "1", "2", "--batch", "3"]
    )
    with open(tmp_path / "bench_commit_compile.json") as f:
        res = json.load(f)
    assert rc == 0, res
    assert res["env"]["jax"] and res["dims"]["layers"] == 3
    assert [r["per_launch"] for r in res["results"]] == [1, 2]
    for r, launches in zip(res["results"], (3, 2)):
        (row,) = r["rows"]
        assert row["launches"] == launches and row["batch"] == 3
        assert row["err"] < 1e-5 and row["compile_s"] > 0 and row["us"] > 0
