"""CPU smoke test of the demo-model training recipe (bole_jax/train/train_demo.py): the same code
path as the GPU run with a tiny model, a few steps and a corpus of this repository's files."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bole_jax.model import forward, init_cache, init_params
from bole_jax.model.mtp import init_mtp_cache, mtp_forward
from bole_jax.train import train_demo as td

REPO = Path(__file__).resolve().parents[2]
ARGS = [
    "--size",
    "tiny",
    "--layers",
    "2",
    "--full-every",
    "2",
    "--batch",
    "4",
    "--seq",
    "64",
    "--mtp-batch",
    "4",
    "--mtp-seq",
    "32",
    "--target-steps",
    "40",
    "--mtp-steps",
    "8",
    "--warmup",
    "10",
    "--mtp-warmup",
    "5",
    "--probe",
    "3",
    "--tokenizer-vocab",
    "384",
    "--mtp-levels",
    "2",
    "--corpus",
    str(REPO / "bole_jax" / "train"),
    str(REPO / "bole_jax" / "model"),
    str(REPO / "docs"),
    "--max-bytes",
    "400000",
    "--val-per-mille",
    "200",
    "--val-windows",
    "32",
    "--samples",
    "4",
    "--log-every",
    "10",
    "--compare-model",
    "none",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of the recipe with the same seed (the second reuses the compiled programs)."""
    out = []
    for name in ("a", "b"):
        d = tmp_path_factory.mktemp(name)
        report = td.main(["--out", str(d / "model"), "--bundle", str(d / "bundle")] + ARGS)
        out.append((report, d))
    return out


def test_loss_decreases_and_log_is_complete(runs):
    report, d = runs[0]
    curve = report["target"]["curve"]
    assert report["target"]["steps"] == 40 and report["mtp"]["steps"] == 8
    assert curve[-1]["loss"] < curve[0]["loss"] - 0.5, curve
    assert report["val_loss"] < np.log(report["config"]["vocab_size"]), report["val_loss"]
    assert 0 < report["val_top1"] < 1
    assert set(report["val_mtp"]) >= {"agree1", "agree2", "kl1", "ce1"}
    assert report["data"]["kept_train"] > 0 and report["data"]["kept_val"] > 0
    for k in ("recipe", "repeat_args", "jax", "device", "git_commit", "stages", "samples"):
        assert k in report
    log = d / "model" / "train_log.json"
    assert (
        log.stat().st_size < 1 << 20
        and json.loads(log.read_text())["val_loss"] == report["val_loss"]
    )
    assert "--target-steps=40" in report["repeat_args"]


def test_same_seed_gives_identical_weights(runs):
    (_, da), (_, db) = runs
    files = sorted(p.name for p in (da / "model").iterdir() if p.name != "train_log.json")
    assert files == sorted(p.name for p in (db / "model").iterdir() if p.name != "train_log.json")
    assert "model.safetensors" in files and "draft_vocab.json" in files
    for f in files:
        assert (da / "model" / f).read_bytes() == (db / "model" / f).read_bytes(), f
    assert runs[0][0]["val_loss"] == runs[1][0]["val_loss"]


def test_bundle_has_few_files(runs):
    import tarfile

    _, d = runs[0]
    names = sorted(p.name for p in (d / "bundle").iterdir())
    assert len(names) <= 8 and "meta.tar" in names and "train_log.json" in names
    with tarfile.open(d / "bundle" / "meta.tar") as tar:
        assert {
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "draft_vocab.json",
        } <= set(tar.getnames())


def test_export_loads_and_generates(runs, tmp_path):
    """The exported folder, split into several shards, loads with its MTP head and generates."""
    from bole_jax import LLM

    _, d = runs[0]
    folder = tmp_path / "sharded"
    shutil.copytree(d / "model", folder)
    td.reshard(folder, 200_000)
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    assert (folder / "model.safetensors.index.json").is_file()
    llm = LLM(str(folder), dtype="float32")
    assert llm.cfg.mtp_num_layers == 1 and "mtp" in llm.params
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())
    out = llm.generate(["def add(a, b):"], max_new_tokens=6, spec="ar")[0]
    assert len(out.token_ids) >= 1


def test_given_tokenizer_and_comparison_model(runs, tmp_path):
    """With run a's tokenizer given (no retraining) the recipe reproduces run a, and the
    comparison evaluates run a's exported (bf16) checkpoint on the same validation windows."""
    report_a, da = runs[0]
    args = list(ARGS)
    i = args.index("--tokenizer-vocab")
    args[i : i + 2] = ["--tokenizer", str(da / "model" / "tokenizer.json")]
    i = args.index("--compare-model")
    args[i + 1] = str(da / "model")
    report = td.main(["--out", str(tmp_path / "c")] + args)
    assert report["val_loss"] == report_a["val_loss"]
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == (
        da / "model" / "model.safetensors"
    ).read_bytes()
    assert report["compare"] is not None
    assert abs(report["compare"]["val_loss"] - report["val_loss"]) < 0.05, report["compare"]


@pytest.fixture(scope="module")
def tiny():
    cfg = td.demo_config(97, 0, "tiny", 2, 2)  # one GDN and one attention layer
    params = init_params(cfg, jax.random.key(3), "float32")
    tokens = jax.random.randint(jax.random.key(4), (2, 24), 0, cfg.vocab_size)
    return cfg, params, tokens


def test_training_forward_matches_the_model_forward(tiny):
    cfg, params, tokens = tiny
    fwd = jax.jit(lambda p, x: forward(p, cfg, x, init_cache(cfg, 2, x.shape[1], jnp.float32))[0])
    got = jax.jit(lambda p, x: td.target_hidden(p, cfg, x))(params, tokens)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(fwd(params, tokens)), rtol=2e-5, atol=2e-5
    )


def test_embedding_gradient_matches_the_gather_gradient(tiny):
    cfg, params, tokens = tiny
    g = jax.random.normal(jax.random.key(5), tokens.shape + (cfg.hidden_size,))
    f1 = lambda e: jnp.sum(td.embed_rows(e, tokens) * g)
    f2 = lambda e: jnp.sum(e[tokens] * g)
    np.testing.assert_allclose(
        np.asarray(jax.grad(f1)(params["embed"])),
        np.asarray(jax.grad(f2)(params["embed"])),
        rtol=1e-5,
        atol=1e-6,
    )


def test_mtp_levels_match_the_drafter_chain(tiny):
    """Level 1 equals mtp_forward over the committed prefix (the drafter's catch-up); level 2 at
    position q equals one drafter query at q whose cache holds the level-1 entries 1..q-1 and
    whose hidden is level 1's output at q-1 (drafter.expand on a chain)."""
    cfg, params, tokens = tiny
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    s = jnp.arange(t)[None, None]

    @jax.jit
    def ours(p, x):
        hidden = td.target_hidden(p, cfg, x)
        h_prev = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], 1)
        kv = [([], []) for _ in p["mtp"]["layers"]]
        out1, kv = td.mtp_level(p, cfg, x, h_prev, pos, kv, td.level_mask(t, 1))
        h2 = jnp.concatenate([jnp.zeros_like(out1[:, :1]), out1[:, :-1]], 1)
        out2, _ = td.mtp_level(p, cfg, x, h2, pos, kv, td.level_mask(t, 2))
        return h_prev, out1, out2

    @jax.jit
    def catch_up(p, x, h_prev):
        cache = init_mtp_cache(cfg, b, t, jnp.float32)
        mask = (s >= 1) & (s <= pos[..., None])
        return mtp_forward(
            p, cfg, x[:, 1:], h_prev[:, 1:], pos[:, 1:], pos[:, 1:], mask[:, 1:], cache
        )

    @jax.jit
    def draft_query(p, x, h, q, cache):
        # Writes the query's entry at slot q (over the level-1 entry there) and sees slots 1..q.
        pq = jnp.full((b, 1), q)
        mask = jnp.broadcast_to((s >= 1) & (s <= q), (b, 1, t))
        tok = jax.lax.dynamic_slice_in_dim(x, q, 1, axis=1)
        return mtp_forward(p, cfg, tok, h, pq, pq, mask, cache)[0][:, 0]

    h_prev, out1, out2 = ours(params, tokens)
    want1, cache = catch_up(params, tokens, h_prev)
    np.testing.assert_allclose(np.asarray(out1[:, 1:]), np.asarray(want1), rtol=2e-5, atol=2e-5)
    for q in (2, 7, t - 1):
        want2 = draft_query(params, tokens, out1[:, q - 1 : q], q, cache)
        np.testing.assert_allclose(np.asarray(out2[:, q]), np.asarray(want2), rtol=2e-5, atol=2e-5)


def test_level_mask_small_case():
    m = np.asarray(td.level_mask(4, 2))[0].astype(int)
    # rows q = 0..3; columns: level-1 entries s = 0..3, then level-2 entries s = 0..3
    want = np.array(
        [
            [0, 0, 0, 0, 1, 0, 0, 0],
            [0, 0, 0, 0, 0, 1, 0, 0],
            [0, 1, 0, 0, 0, 0, 1, 0],
            [0, 1, 1, 0, 0, 0, 0, 1],
        ]
    )
    np.testing.assert_array_equal(m, want)


def test_lr_schedule():
    f = lambda i, n: float(td.lr_at(jnp.int32(i), jnp.float32(n), 1.0, 10.0, 0.1))
    assert f(0, 100) == pytest.approx(0.1) and f(9, 100) == pytest.approx(1.0)
    assert f(5, 100) == f(5, 1 << 30)  # warm-up independent of the step count
    assert f(55, 100) == pytest.approx(0.55, abs=1e-6) and f(100, 100) == pytest.approx(0.1)


def test_corpus_split_is_by_content_and_deduplicated(tmp_path):
    from bole_jax.train.corpus import collect_corpus

    for i in range(60):
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "b").mkdir(exist_ok=True)
        body = f"def f{i}(x):\n    return x + {i}\n" * 4
        (tmp_path / "a" / f"m{i}.py").write_text(body)
        (tmp_path / "b" / f"copy{i}.py").write_text(body)  # exact duplicates under other names
    (tmp_path / "a" / "LICENSE.txt").write_text("licence text " * 20)
    (tmp_path / "a" / "table.py").write_text("X = [\n" + "    12345678, 87654321,\n" * 50 + "]\n")
    (tmp_path / "a" / "vocab.txt").write_text("".join(f"w{i}\n" for i in range(2000)))
    c = collect_corpus([tmp_path], val_per_mille=300, min_file_bytes=8)
    assert c.stats["kept_train"] + c.stats["kept_val"] == 60 and c.stats["duplicate"] == 60
    assert 0 < c.stats["kept_val"] < 60 and c.stats["numeric"] == 1 and c.stats["word_list"] == 1
    assert not any("licence" in d for d in c.train + c.val)
    c2 = collect_corpus([tmp_path / "b", tmp_path / "a"], val_per_mille=300, min_file_bytes=8)
    assert sorted(c2.val) == sorted(c.val)  # the split follows content, not names or order
