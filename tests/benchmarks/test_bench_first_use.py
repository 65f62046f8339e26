import json

from benchmarks import bench_first_use


def test_first_use_times_cold_and_warm_processes(tmp_path, capsys):
    """One cold + warm pair of the README command (a few tokens): both walls and the command's
    last line recorded, and the JSON says what ran where."""
    bench_first_use.main(["--reps", "1", "--out", str(tmp_path), "--", "--max-new-tokens", "4"])
    d = json.loads((tmp_path / "first_use.json").read_text())
    (row,) = d["rows"]
    assert row["cold_s"] > 0 and row["warm_s"] > 0
    assert "[ar] 4 tokens" in row["last_line"], row["last_line"]
    assert d["run"].endswith("generate def fibonacci(n): --max-new-tokens 4")
    assert d["env"]["git_commit"] and d["env"]["cpu_count"] >= 1
    assert d["summary"]["cold_s_median"] == row["cold_s"]
    assert "median: cold" in capsys.readouterr().out
