"""The teacher-forced numerics measurement (bole_jax.measure.numerics, benchmarks/bench_numerics.py):
in fp32 every mode replays AR's tokens at fp32 rounding distance; a real difference (another
lm_head for the reference) shows up as logit error and flips; the CLI writes its JSON."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import pytest

from bole_jax.measure import numerics as nm
from bole_jax.model import ModelConfig, init_params
from bole_jax.model.presets import peaked_lm_head
from bole_jax.pallas.options import KernelOptions

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.tiny("qwen3_next", tie_word_embeddings=False)
    params = peaked_lm_head(init_params(cfg, jax.random.key(3), "float32"), cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (7, 12, 3)]  # ragged
    return cfg, params, prompts


def test_every_mode_replays_ar_within_fp32_rounding(tiny):
    cfg, params, prompts = tiny
    variants = [
        nm.parse_variant(v)
        for v in ("ar", "chunk", "chain", "pernode", "bole", "bole:backend=pallas")
    ]
    r = nm.teacher_forced(params, cfg, prompts, variants, steps=3, depth=3, nodes=9)
    assert r["ar"]["positions"] == 3 * 3 * 4 and r["ar"]["tokens"] == 13
    for row in r["variants"]:
        assert row["positions"] == 36, row
        assert row["flips"] == 0 and row["flip_gaps"] == [], row
        assert row["max_abs_err"] < 1e-4 and row["margin_err_p99"] < 1e-4, row
        assert row["state_rel_err"] < 1e-5, row
    assert [row["variant"] for row in r["variants"]][-1] == "bole:backend=pallas"


def test_a_different_reference_shows_as_error_and_flips(tiny):
    """The measure can fail: AR run with other weights (an independent random lm_head) is far
    from every variant, and its greedy tokens are not theirs."""
    cfg, params, prompts = tiny
    other = dict(params)
    head = np.asarray(params["lm_head"])
    rng = np.random.default_rng(1)
    other["lm_head"] = rng.normal(0, head.std(), head.shape).astype(np.float32)
    r = nm.teacher_forced(
        params, cfg, prompts, [nm.parse_variant("bole")], steps=2, depth=3, ref_params=other
    )
    (row,) = r["variants"]
    assert row["max_abs_err"] > 0.1 and row["flips"] > 0, row
    assert row["margin_err_mean"] > 0.1, row
    assert len(row["flip_gaps"]) == row["flips"]


def test_variants_parse_and_name_themselves():
    v = nm.parse_variant("bole:backend=pallas,interpret_numerics=device,tree_gdn_bf16=0")
    assert (v.mode, v.backend) == ("bole", "pallas")
    assert v.kernels == KernelOptions(interpret_numerics="device", tree_gdn_bf16=False)
    assert nm.parse_variant(v.name) == v
    assert nm.parse_variant("chain").name == "chain"
    for bad, match in (
        ("tree", "unknown mode"),
        ("bole:backend=tpu", "unknown backend"),
        ("bole:tree_gdn_bf16=yes", "1 or 0"),
        ("bole:colour=red", "unknown key"),
        ("bole:tree_gdn_state", "KEY=VALUE"),
        ("bole:tree_gdn_state=fp16", "tree_gdn_state"),
    ):
        with pytest.raises(ValueError, match=match):
            nm.parse_variant(bad)


def test_cli_prints_and_writes_json(tmp_path, capsys):
    import bench_numerics

    argv = [
        "--preset",
        "tiny",
        "--batch",
        "2",
        "--prompt-len",
        "5",
        "--steps",
        "1",
        "--depth",
        "2",
        "--nodes",
        "5",
        "--dtype",
        "float32",
        "--variants",
        "ar",
        "bole",
        "--out",
        str(tmp_path),
    ]
    bench_numerics.main(argv)
    out = capsys.readouterr().out
    assert "flip_rate" in out and "bole:backend=pallas,interpret_numerics=device" in out
    data = json.loads((tmp_path / "numerics_tiny.json").read_text())
    assert data["command"].startswith("python ") and "--preset tiny" in data["command"]
    assert {"git_commit", "jax", "device"} <= set(data["env"])
    assert [r["variant"] for r in data["result"]["variants"]] == [
        "ar",
        "bole:backend=pallas,interpret_numerics=device",
    ]
    with pytest.raises(SystemExit):
        bench_numerics.main(["--preset", "tiny", "--model", "x"])
    with pytest.raises(SystemExit):
        bench_numerics.main(["--steps", "0"])
