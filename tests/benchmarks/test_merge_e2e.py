"""benchmarks/merge_e2e.py: rows of several runs of one model merged, mismatches refused."""

import importlib.util
import json
import os

import pytest

_spec = importlib.util.spec_from_file_location(
    "merge_e2e", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "merge_e2e.py")
)
merge_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(merge_e2e)


def _run(tmp_path, name, batches, preset="qwen3.5-9b", device="NVIDIA H200"):
    rows = [
        dict(batch=b, mode=m, tokens_per_s=float(b), step_ms=1.0)
        for b in batches
        for m in ("ar", "bole")
    ]
    r = dict(
        command=f"bench {name}",
        args=dict(preset=preset, model=None),
        dtype="bfloat16",
        env=dict(device=device, jax="0.11.2", git_commit="abc"),
        rows=rows,
        breakdown=[],
    )
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(r))
    return str(p)


def test_merge_keeps_every_row_with_its_source(tmp_path):
    a, b = _run(tmp_path, "a", [16, 1]), _run(tmp_path, "b", [4])
    out = tmp_path / "all.json"
    assert merge_e2e.main([a, b, "--out", str(out), "--no-plots"]) == 0
    m = json.loads(out.read_text())
    assert [(r["batch"], r["mode"], r["source"]) for r in m["rows"]] == [
        (1, "ar", 0),
        (1, "bole", 0),
        (4, "ar", 1),
        (4, "bole", 1),
        (16, "ar", 0),
        (16, "bole", 0),
    ]
    assert [s["command"] for s in m["sources"]] == ["bench a", "bench b"]


@pytest.mark.parametrize("kw", [dict(preset="qwen3.5-4b"), dict(device="NVIDIA H100")])
def test_merge_refuses_other_models_or_devices(tmp_path, kw):
    a, b = _run(tmp_path, "a", [1]), _run(tmp_path, "b", [4], **kw)
    with pytest.raises(SystemExit, match="differs"):
        merge_e2e.merge([a, b])


def test_merge_refuses_a_point_twice(tmp_path):
    a, b = _run(tmp_path, "a", [1]), _run(tmp_path, "b", [1])
    with pytest.raises(SystemExit, match="already"):
        merge_e2e.merge([a, b])


def test_merge_later_wins_keeps_the_rerun(tmp_path):
    a, b = _run(tmp_path, "a", [1, 16]), _run(tmp_path, "b", [16])
    m = merge_e2e.merge([a, b], later_wins=True)
    assert [(r["batch"], r["mode"], r["source"]) for r in m["rows"]] == [
        (1, "ar", 0),
        (1, "bole", 0),
        (16, "ar", 1),
        (16, "bole", 1),
    ]
