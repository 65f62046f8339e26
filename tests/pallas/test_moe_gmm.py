"""MoE grouped matmul (bole_jax/pallas/moe_gmm.py): row layout, Pallas kernel vs reference, the
experts path built on it (layers.moe_experts_gmm) vs the dense reference, expert-parallel drops,
the Triton lowering and the GPU check script's CPU smoke run.

CPU only: the kernel runs in Pallas interpret mode. Random inputs are fresh every run (the seed
is in every failure message) plus a fixed seed. Kept small: CI runs it on 2 cores.
"""

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RUN_SEED

from bole_jax.model import ModelConfig, layers
from bole_jax.pallas import moe_gmm
from bole_jax.pallas.moe_gmm import GMMConfig, gmm, gmm_ref, group_layout

SEEDS = [0, RUN_SEED]
TOL = {np.float32: 2e-6, jnp.bfloat16: 1e-2}  # bf16: output rounding and summation order


def rel(a, b):
    a, b = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _routing(rng, kind: str, pairs: int, num_experts: int) -> np.ndarray:
    """[P] expert ids in [0, E] (E = dropped)."""
    if kind == "random":
        return rng.integers(0, num_experts, pairs)
    if kind == "one_expert":  # every pair on one expert: one long group, the rest empty
        return np.full(pairs, rng.integers(num_experts))
    if kind == "sparse":  # most experts empty
        return rng.choice(rng.choice(num_experts, 3, replace=False), pairs)
    if kind == "dropped":  # about half the pairs dropped (expert parallelism)
        return np.where(rng.random(pairs) < 0.5, num_experts, rng.integers(0, num_experts, pairs))
    raise ValueError(kind)


def _silu(x):
    return x / (1 + np.exp(-x))


def _per_pair(x, w, experts, swiglu):
    """fp64 numpy: each pair's row times its expert's weights (dropped pairs: unused)."""
    w64 = np.asarray(w, np.float64)[np.minimum(experts, w.shape[0] - 1)]
    y = np.einsum("pk,pkn->pn", np.asarray(x, np.float64), w64)
    if swiglu:
        gate, up = np.split(y, 2, axis=-1)
        y = _silu(gate) * up
    return y


# ----------------------------------------------------------------------------- row layout


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["random", "one_expert", "sparse", "dropped"])
@pytest.mark.parametrize("pairs,num_experts,bm", [(40, 4, 16), (7, 16, 16), (300, 16, 32)])
def test_group_layout(seed, kind, pairs, num_experts, bm):
    """Every kept pair has its own row, inside a tile of its expert; groups in expert order;
    dropped pairs and padding rows point past the end; unused tiles are idle (E)."""
    rng = np.random.default_rng(seed)
    e = _routing(rng, kind, pairs, num_experts).astype(np.int32)
    lay = jax.tree.map(np.asarray, group_layout(jnp.asarray(e), num_experts, bm))
    tiles = moe_gmm.num_tiles(pairs, num_experts, bm)
    rows = tiles * bm
    assert lay.tile_expert.shape == (tiles,) and lay.row_pair.shape == (rows,), f"seed {seed}"
    kept = e < num_experts
    assert np.all(lay.pair_row[~kept] == rows), f"seed {seed}"
    r = lay.pair_row[kept]
    assert len(np.unique(r)) == len(r) and np.all(r < rows), f"seed {seed}"
    np.testing.assert_array_equal(lay.tile_expert[r // bm], e[kept], f"seed {seed}")
    np.testing.assert_array_equal(lay.row_pair[r], np.nonzero(kept)[0], f"seed {seed}")
    assert np.sum(lay.row_pair < pairs) == kept.sum(), f"seed {seed}"
    sizes = np.bincount(e[kept], minlength=num_experts)
    used = int(np.sum(-(-sizes // bm)))
    want = np.concatenate(
        [np.repeat(np.arange(num_experts), -(-sizes // bm)), np.full(tiles - used, num_experts)]
    )
    np.testing.assert_array_equal(lay.tile_expert, want, f"seed {seed}")


# ----------------------------------------------------------------------------- kernel


# (E, K, N, pairs, bm, routing, dtype, swiglu, config): few rows per expert (decode-like),
# many rows, empty experts, all pairs on one expert, dropped pairs, E in {4, 16, 64}, bf16 and
# fp32, dims that need padding (K 40, N/2 24), several K steps and column blocks. Each case
# compiles the interpret-mode kernel once (its seeds share it): that is most of the time.
F32, BF16 = np.float32, jnp.bfloat16
KERNEL_CASES = [
    (4, 64, 64, 40, 16, "random", F32, True, None),
    (4, 32, 96, 200, 32, "one_expert", BF16, False, GMMConfig(32, 32, 16)),
    (16, 40, 48, 60, 16, "sparse", F32, True, None),
    (16, 48, 32, 100, 16, "dropped", BF16, False, None),
    (64, 64, 128, 300, 16, "random", BF16, True, GMMConfig(16, 32, 32)),
]


def _kernel_case_id(c):
    return f"E{c[0]}-K{c[1]}-N{c[2]}-P{c[3]}-bm{c[4]}-{c[5]}-{jnp.dtype(c[6]).name}" + (
        "-swiglu" if c[7] else ""
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=_kernel_case_id)
def test_gmm_kernel_matches_reference(seed, case):
    """Kernel (interpret) vs gmm_ref on the used rows, and gmm_ref vs each pair's own product."""
    num_experts, k, n, pairs, bm, kind, dtype, swiglu, cfg = case
    rng = np.random.default_rng(seed)
    e = _routing(rng, kind, pairs, num_experts).astype(np.int32)
    x = jnp.asarray(rng.normal(size=(pairs, k)), dtype)
    w = jnp.asarray(rng.normal(size=(num_experts, k, n)) * k**-0.5, dtype)
    lay = group_layout(jnp.asarray(e), num_experts, bm)
    xs = jnp.take(x, lay.row_pair, axis=0, mode="fill", fill_value=0)
    got = gmm(xs, w, lay.tile_expert, swiglu=swiglu, config=cfg, backend="pallas", interpret=True)
    ref = gmm_ref(xs, w, lay.tile_expert, swiglu=swiglu)
    assert got.shape == ref.shape == (xs.shape[0], n // 2 if swiglu else n)
    assert got.dtype == ref.dtype == x.dtype
    used = np.repeat(np.asarray(lay.tile_expert) < num_experts, bm)
    err = rel(np.asarray(got, np.float32)[used], np.asarray(ref, np.float32)[used])
    assert err <= TOL[dtype], f"seed {seed}: kernel vs reference rel err {err:.2e}"
    kept = e < num_experts
    rows = np.asarray(lay.pair_row)[kept]
    want = _per_pair(np.asarray(x, np.float32), np.asarray(w, np.float32), e, swiglu)[kept]
    err = rel(np.asarray(ref, np.float32)[rows], want)
    assert err <= TOL[dtype], f"seed {seed}: reference vs per-pair rel err {err:.2e}"
    assert not np.any(np.asarray(ref)[~used]), "idle tiles of the reference must be zero"


def test_gmm_rejects_bad_arguments():
    x = jnp.zeros((32, 32), jnp.float32)
    w = jnp.zeros((4, 32, 64), jnp.float32)
    te = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="block_m"):
        gmm(x, w, te, config=GMMConfig(block_m=32), backend="pallas", interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        gmm(x, w, te, config=GMMConfig(block_m=16, block_n=48), backend="pallas", interpret=True)
    with pytest.raises(ValueError, match="w \\[E, K, N\\]"):
        gmm(x, w[:, :16], te, backend="pallas", interpret=True)


@pytest.mark.parametrize("swiglu,bm", [(True, 16), (False, 128)])
def test_gmm_lowers_to_triton(swiglu, bm):
    """The kernel traces through the Pallas->Triton lowering at Qwen3-Next-80B dims per device
    (256 experts, hidden 2048, moe_intermediate 512, bf16): dynamic indexing of the weights'
    expert axis, the K loop, the fused SwiGLU. Does not run Triton's own compiler."""
    e, k, n = (256, 2048, 1024) if swiglu else (256, 512, 2048)
    tiles = moe_gmm.num_tiles(1280, e, bm)
    x = jax.ShapeDtypeStruct((tiles * bm, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((e, k, n), jnp.bfloat16)
    te = jax.ShapeDtypeStruct((tiles,), jnp.int32)
    fn = jax.jit(lambda x, w, te: gmm(x, w, te, swiglu=swiglu, backend="pallas", interpret=False))
    text = fn.trace(x, w, te).lower(lowering_platforms=("cuda",)).as_text()
    assert "bole_moe_gmm" in text


# ----------------------------------------------------------------------------- experts path


def _moe_params(rng, num_experts, h, inter, dtype):
    return {
        "router": jnp.asarray(rng.normal(size=(h, num_experts)), jnp.float32),
        "w_gate_up": jnp.asarray(rng.normal(size=(num_experts, h, 2 * inter)) * h**-0.5, dtype),
        "w_down": jnp.asarray(rng.normal(size=(num_experts, inter, h)) * inter**-0.5, dtype),
    }


# One jitted function per backend for all cases (the shapes differ, the seeds share compilations).
_EXPERTS = {
    b: jax.jit(functools.partial(layers.moe_experts_gmm, backend=b))
    for b in ("pallas", "reference")
}
_DENSE = jax.jit(layers.moe_experts_dense)


def _routed(seed, tokens, num_experts, topk, dtype):
    rng = np.random.default_rng(seed)
    cfg = ModelConfig.tiny(
        "qwen3_next", moe=True, num_experts=num_experts, num_experts_per_tok=topk
    )
    p = _moe_params(rng, num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype)
    x = jnp.asarray(rng.normal(size=(tokens, cfg.hidden_size)), dtype)
    w, e = layers.moe_route(p["router"], x, cfg)
    return p, x, w, e


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "tokens,num_experts,topk,dtype,backends",
    [
        (1, 8, 2, F32, ("pallas", "reference")),
        (64, 16, 4, BF16, ("pallas",)),
        (40, 64, 8, F32, ("pallas",)),
    ],
)
def test_moe_experts_gmm_matches_dense(seed, tokens, num_experts, topk, dtype, backends):
    """The grouped-matmul experts path vs every expert on every token (moe_experts_dense, fp32),
    on softmax top-k routing of random tokens: one token (fewer pairs than experts), many rows
    per expert in bf16, 64 experts."""
    p, x, w, e = _routed(seed, tokens, num_experts, topk, dtype)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (p, x, w))
    ref = _DENSE(*f32, e)
    for backend in backends:
        got = _EXPERTS[backend](p, x, w, e)
        assert got.dtype == x.dtype
        err = rel(np.asarray(got, np.float32), ref)
        assert err <= 3 * TOL[dtype], f"seed {seed} {backend}: rel err {err:.2e}"


@pytest.mark.parametrize("seed", SEEDS)
def test_moe_experts_local_drops_foreign_pairs(seed, monkeypatch):
    """Expert parallelism with the gmm path: the pairs of other devices' experts reach it as
    dropped (id E_local) and the result equals the dense reference restricted to the local
    experts."""
    num_experts, local, first = 16, 4, 8
    p, x, w, e = _routed(seed, 20, num_experts, 4, F32)
    seen = []
    real = _EXPERTS["pallas"]

    def spy(p, x, top_w, top_e):
        seen.append(top_e)
        return real(p, x, top_w, top_e)

    monkeypatch.setattr(layers, "moe_experts_gmm", spy)  # the identity moe_experts_local tests
    p_local = {k: v[first : first + local] for k, v in p.items() if k != "router"}
    got = layers.moe_experts_local(functools.partial(spy), p_local, x, w, e, first)
    mine = (e >= first) & (e < first + local)
    np.testing.assert_array_equal(seen[0], np.where(mine, e - first, local))
    ref = _DENSE(p, x, jnp.where(mine, w, 0), e)
    assert rel(got, ref) <= 1e-5, f"seed {seed}"


def test_moe_picks_gmm_on_gpu(monkeypatch):
    """moe's default: the grouped matmul on a GPU at every token count, the jnp paths on CPU."""
    cfg = ModelConfig.tiny("qwen3_next", moe=True)
    assert layers.default_experts_impl(1, cfg) is layers.moe_experts_gather
    assert layers.default_experts_impl(64, cfg) is layers.moe_experts_sorted
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for tokens in (1, 4096):
        impl = layers.default_experts_impl(tokens, cfg)
        assert impl.func is layers.moe_experts_gmm
        want = tokens * cfg.num_experts_per_tok / cfg.num_experts
        assert impl.keywords["rows_per_expert"] == want


# ----------------------------------------------------------------------------- GPU check script


def test_bench_moe_tiny(tmp_path):
    """benchmarks/bench_moe.py --tiny on CPU: checks pass, every implementation timed, JSON.
    fp32: the gather is then one program for the check and the timing (compiles are the time)."""
    sys.path.insert(
        0,
        os.path.join(
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            "benchmarks",
        ),
    )
    import bench_moe

    bench_moe.main(
        [
            "--tiny",
            "--tokens",
            "8",
            "--dtype",
            "float32",
            "--out",
            str(tmp_path),
            "--timer",
            "wall",
            "--reps",
            "1",
            "--warmup",
            "1",
        ]
    )
    res = json.loads((tmp_path / "bench_moe.json").read_text())
    assert res["checks"] and all(c["ok"] for c in res["checks"]), res["checks"]
    assert {"command", "git_commit", "device", "jax"} <= set(res)
    for row in res["points"]:
        assert row["gmm"]["us"] > 0 and row["gather"]["us"] > 0 and row["sorted"]["us"] > 0
