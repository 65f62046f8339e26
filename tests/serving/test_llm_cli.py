"""The generation API and the command line: outputs, stops, errors, no recompilation."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import start_niced

from bole_jax import LLM, ModelConfig
from bole_jax import llm as llm_mod
from bole_jax.serving import cli

REPO = Path(__file__).resolve().parents[2]
_stdin_run = None  # (Popen, stdout file, stderr file, cache dir) of test_cli_stdin_subprocess_...


def _start_stdin_run():
    """`python -m bole_jax generate` on the embedded default model, the prompt on stdin, with
    $BOLE_JAX_CACHE in a fresh folder (the persistent compilation cache goes to its xla/)."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    cache = tempfile.TemporaryDirectory(prefix="bole_jax_cache_")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("BOLE_JAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")
    }
    env["BOLE_JAX_CACHE"] = cache.name
    proc = start_niced(
        [
            sys.executable,
            "-m",
            "bole_jax",
            "generate",
            "--max-new-tokens",
            "4",
            "--no-progress",
            "--json",
            "--spec",
            "ar",
        ],
        stdin=subprocess.PIPE,
        stdout=out,
        stderr=err,
        text=True,
        cwd=REPO,
        env=env,
    )
    proc.stdin.write("def fibonacci(n):\n")
    proc.stdin.close()
    return proc, out, err, cache


def start_background(names):
    """Called by conftest.py right after collection: the subprocess test runs meanwhile."""
    global _stdin_run
    if "test_cli_stdin_subprocess_default_model" in names and _stdin_run is None:
        _stdin_run = _start_stdin_run()


def stop_background():
    global _stdin_run
    if _stdin_run is not None:
        proc, out, err, cache = _stdin_run
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()
        cache.cleanup()
    _stdin_run = None


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir)


def test_generate_texts_ids_stats(llm):
    outs = llm.generate(["def add(a, b):", "Hello"], max_new_tokens=8, spec="ar")
    assert len(outs) == 2
    for o in outs:
        assert 1 <= len(o.token_ids) <= 8
        assert o.text == llm.tokenizer.decode(o.token_ids) or o.finish_reason == "stop"
        assert o.stats["generated_tokens"] == len(o.token_ids)
        assert o.finish_reason in ("stop", "length")
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("def add(a, b):")


def test_repeated_calls_do_not_recompile(llm):
    """Other prompts, sampling parameters and batch sizes of a batch bucket reuse its programs
    (generate decodes with segment_fn(mode, bucket); the prefill and first token are module-level
    jits shared by every LLM): two per bucket at most, the all-greedy one and the one for any
    sampling (`SamplingParams.greedy`)."""
    from bole_jax.spec_decode import loop

    llm.generate(["a b c"], max_new_tokens=8, spec="ar")
    llm.generate(["p", "q r"], max_new_tokens=8, spec="ar")
    programs = [
        llm.segment_fn("ar", 1),
        llm.segment_fn("ar", 2),
        loop.prefill_chunk,
        loop.first_token,
    ]
    greedy_only = [f._cache_size() for f in programs]
    assert min(greedy_only) >= 1
    llm.generate(["x y"], max_new_tokens=8, spec="ar", temperature=0.7, top_p=0.9, seed=3)
    llm.generate(["x", "y z"], max_new_tokens=8, spec="ar", temperature=0.5)
    before = [f._cache_size() for f in programs]
    # the sampled program once per bucket (decode segment, first token); the prefill is shared
    assert [b - g for b, g in zip(before, greedy_only)] == [1, 1, 0, 2]
    llm.generate(["def", "q r s"], max_new_tokens=8, spec="ar", top_k=5, temperature=1.0)
    llm.generate(["u v"], max_new_tokens=8, spec="ar", temperature=0.3, seed=9)
    llm.generate(["w", "w x"], max_new_tokens=8, spec="ar")
    assert [f._cache_size() for f in programs] == before


class _Compiles:
    """Counts jaxpr -> MLIR lowerings and XLA backend compilations (jax.monitoring events) while
    active: an in-memory jit cache hit does neither, a persistent-cache hit still lowers."""

    EVENTS = (
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )

    def __enter__(self):
        import jax.monitoring

        self.events = []
        self._cb = lambda name, secs, **kw: name in self.EVENTS and self.events.append(name)
        jax.monitoring.register_event_duration_secs_listener(self._cb)
        return self

    def __exit__(self, *exc):
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._cb)


def test_compile_counter_sees_compiles(llm):
    """The counter the no-compile tests rely on does count a new program."""
    import jax
    import jax.numpy as jnp

    with _Compiles() as c:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0))
    assert c.events


@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_other_max_new_tokens_does_not_compile(llm, mode):
    """A second generate with another max_new_tokens of the same output bucket (and prompts of the
    same prefill bucket) compiles nothing; its tokens are trimmed to the requested length and
    equal the first call's prefix (greedy)."""
    prompts = ["def add(a, b):", "Hello"]
    long = llm.generate(prompts, max_new_tokens=12, spec=mode)
    with _Compiles() as c:
        short = llm.generate(prompts, max_new_tokens=5, spec=mode)
        one = llm.generate(prompts, max_new_tokens=1, spec=mode)
    assert c.events == []
    for a, b, o in zip(long, short, one):
        assert len(b.token_ids) <= 5 and len(o.token_ids) == 1
        assert b.token_ids == a.token_ids[: len(b.token_ids)]
        ended = len(b.token_ids) < 5 or b.token_ids[-1] in llm.eos_ids
        assert b.finish_reason == ("stop" if ended else "length")
        assert b.stats["generated_tokens"] == len(b.token_ids)
        if len(a.token_ids) >= 5:
            assert len(b.token_ids) == 5
        assert o.token_ids == a.token_ids[:1]


def test_prefill_width_bounds_the_attention_scores(llm):
    """A wide batch at a long capacity prefills in narrower pieces: one attention layer's fp32
    scores (rows x heads x width x capacity x 4 bytes) stay within PREFILL_SCORES_BYTES."""
    cfg, cap = llm.cfg, llm_mod.PREFILL_SCORES_BYTES
    assert llm_mod.prefill_width(cfg, 1, 4096, 5) == 16  # short prompts: 16 at least
    assert llm_mod.prefill_width(cfg, 1, 4096, 1000) == llm_mod.PREFILL_CHUNK
    for rows, capacity in ((64, 16384), (128, 262144), (1024, 262144)):
        w = llm_mod.prefill_width(cfg, rows, capacity, 4000)
        assert w >= 1 and w & (w - 1) == 0
        assert rows * cfg.num_heads * w * capacity * 4 <= cap or w == 1
        assert w == 1 or 2 * rows * cfg.num_heads * w * capacity * 4 > cap  # the widest that fits


@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_narrow_prefill_pieces_give_the_same_tokens(llm, mode, monkeypatch):
    """Prefilling in 2-token pieces (a scores cap that only fits 2 query rows) gives the same
    greedy tokens as one piece."""
    prompts = ["def add(a, b):\n    return", "Hello there, how are you"]
    ref = llm.generate(prompts, max_new_tokens=6, spec=mode)
    widths = []
    real = llm_mod.prefill_width

    def narrow(cfg, rows, capacity, longest):
        # the cap that fits exactly 2 query rows of this batch at this capacity
        monkeypatch.setattr(
            llm_mod, "PREFILL_SCORES_BYTES", 2 * rows * cfg.num_heads * capacity * 4
        )
        widths.append(real(cfg, rows, capacity, longest))
        return widths[-1]

    monkeypatch.setattr(llm_mod, "prefill_width", narrow)
    got = llm.generate(prompts, max_new_tokens=6, spec=mode)
    assert widths and set(widths) == {2}
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


def test_stop_string_and_max_tokens(llm):
    # 8 new tokens, one prompt: the program test_repeated_calls_do_not_recompile compiled
    base = llm.generate(["import os"], max_new_tokens=8, spec="ar")[0]
    text = base.text
    assert len(text) > 3
    stop = text[2:4]
    out = llm.generate(["import os"], max_new_tokens=8, spec="ar", stop=[stop])[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text and text.startswith(out.text)
    assert len(out.token_ids) <= len(base.token_ids)


def test_sampling_is_seeded(llm):
    a = llm.generate(["def f("], max_new_tokens=8, temperature=1.0, seed=5, spec="ar")[0]
    b = llm.generate(["def f("], max_new_tokens=8, temperature=1.0, seed=5, spec="ar")[0]
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_seed_gives_same_samples_whatever_the_batching(model_dir, mode):
    """generate(seed=s): each prompt's sample depends on (seed, its index in the call) only, not on
    max_batch_size or its row in a batch (with max_batch_size 4, prompt 2 is row 2 of the only
    batch; with 2, row 0 of the second; with 1, row 0 of the third). The tree width of bole is the
    same at batch buckets 1, 2 and 4 (4-64 by batch: 64 up to batch 4), so the trees match too."""
    prompts = ["def f(", "import os", "class A:", "x = ["]
    kw = dict(max_new_tokens=8, temperature=1.0, top_k=50, seed=11, spec=mode)
    runs = [
        [o.token_ids for o in LLM(model_dir, max_batch_size=b).generate(prompts, **kw)]
        for b in (4, 2, 1)
    ]
    assert runs[0] == runs[1] == runs[2]
    assert len({tuple(r) for r in runs[0]}) > 1  # different prompts, different streams
    other = [
        o.token_ids
        for o in LLM(model_dir, max_batch_size=4).generate(prompts, **{**kw, "seed": 12})
    ]
    assert other != runs[0]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(spec="medusa"), "unknown spec mode"),
        (dict(max_context=3), "maximum context"),
    ],
)
def test_bad_arguments(llm, kwargs, match):
    kw = dict(max_new_tokens=4)
    kw.update(kwargs)
    with pytest.raises(ValueError, match=match):
        llm.generate(["hello"], **kw)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], max_new_tokens=4)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 99999]], max_new_tokens=4)
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM("/nonexistent/model")
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM(ModelConfig.tiny("qwen3_next")).generate(["text"], max_new_tokens=2)


def test_cli_generate_file_output_json(model_dir, tmp_path, capsys):
    """--json prints JSON lines (one object per prompt, as --output writes them); the other fields
    of a JSONL input object (e.g. id) are copied to its record."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"id": "a-1", "prompt": "def f(x):", "meta": {"k": [1]}})
        + "\n"
        + json.dumps("print(")
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    rc = cli.main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--file",
            str(prompts),
            "--output",
            str(out),
            "--json",
            "--max-new-tokens",
            "5",
            "--no-progress",
            "--spec",
            "bole",
        ]
    )
    assert rc == 0
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["prompt"] for r in lines] == ["def f(x):", "print("]
    assert printed == lines
    assert lines[0]["id"] == "a-1" and lines[0]["meta"] == {"k": [1]} and "id" not in lines[1]
    assert all(r["stats"]["mode"] == "bole" for r in lines)
    assert all(len(r["token_ids"]) <= 5 for r in lines)


def _subparsers(parser):
    import argparse

    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_cli_help_shows_every_default():
    """Every option of every command states its default in --help (the formatter appends it, or
    the help says it in words)."""
    parser = cli.build_parser()
    for name, sub in _subparsers(parser).items():
        fmt = sub.formatter_class(prog=sub.prog)
        for a in sub._actions:
            if a.help == "==SUPPRESS==" or a.dest == "help" or a.required or a.nargs == "+":
                continue
            text = fmt._get_help_string(a) % {**vars(a), "prog": sub.prog}
            assert "default" in text.lower(), (name, a.option_strings or a.dest, text)
        assert "default" in sub.format_help()
    g = _subparsers(parser)["generate"]
    helps = {
        a.dest: fmt._get_help_string(a) for a in g._actions for fmt in [g.formatter_class("g")]
    }
    assert "(default: %(default)s)" in helps["temperature"]  # 0.0 is a value, not "unset"
    assert "default: the fastest measured" in helps["spec"]


def test_cli_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    printed = capsys.readouterr().out.strip()
    try:
        want = metadata.version("bole-jax")
    except metadata.PackageNotFoundError:
        import bole_jax

        want = bole_jax.__version__
    assert printed == f"bole-jax {want}"


def test_cli_batch_size_and_sampling_names():
    """One name, --max-batch-size, everywhere; the old spellings still parse but are not listed.
    Sampling flags as in vLLM, --max-new-tokens kept for --max-tokens."""
    parser = cli.build_parser()
    for argv, want in (
        (["generate"], 64),
        (["generate", "--max-batch-size", "3"], 3),
        (["generate", "--batch-size", "5"], 5),
        (["generate", "--max-batch", "6"], 6),
    ):
        assert parser.parse_args(argv).max_batch_size == want
    for argv, want in (
        (["serve"], 8),
        (["serve", "--max-batch-size", "3"], 3),
        (["serve", "--max-batch", "4"], 4),
        (["serve", "--batch-size", "2"], 2),
    ):
        args = parser.parse_args(argv)
        assert args.max_batch_size == want and args.max_batch == want  # (serve's old name kept)
    for name in ("generate", "serve"):
        text = _subparsers(parser)[name].format_help()
        assert "--max-batch-size" in text and "--batch-size" not in text
        assert "--max-batch " not in text and "--max-batch\n" not in text
    args = parser.parse_args(
        [
            "generate",
            "--max-tokens",
            "7",
            "--temperature",
            "0.5",
            "--top-p",
            "0.9",
            "--top-k",
            "3",
            "--seed",
            "11",
        ]
    )
    assert (args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed) == (
        7,
        0.5,
        0.9,
        3,
        11,
    )
    assert parser.parse_args(["generate", "--max-new-tokens", "9"]).max_tokens == 9


def test_cli_tree_args(model_dir):
    parser = cli.build_parser()
    assert cli.spec_options_from_args(parser.parse_args(["generate"])) is None
    args = parser.parse_args(
        ["generate", "--tree-nodes", "8", "--tree-topk", "2", "--tree-depth", "3"]
    )
    opts = cli.spec_options_from_args(args)
    assert opts == dict(num_nodes=8, topk=2, depth=3)
    shape = LLM(model_dir, spec_options=opts)._spec_config("bole", 1).shape
    assert (shape.topk, shape.depth, shape.num_nodes) == (2, 3, 8)
    serve = parser.parse_args(["serve", "--tree-budget", "32", "--calibration", "t.json"])
    assert cli.spec_options_from_args(serve) == dict(budget=32, calibration="t.json")
    with pytest.raises(ValueError, match="--tree-depth must be >= 1"):
        cli.spec_options_from_args(parser.parse_args(["generate", "--tree-depth", "0"]))


def test_cli_errors(model_dir, tmp_path, capsys):
    assert cli.main(["generate", "--model", str(tmp_path / "missing"), "x", "--no-progress"]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(SystemExit, match="invalid JSON"):
        cli.main(["generate", "--model", str(model_dir), "--file", str(bad)])


def test_cli_stdin_subprocess_default_model():
    """`python -m bole_jax generate` reading stdin, on the embedded default model (started in the
    background by start_background, else here)."""
    global _stdin_run
    if _stdin_run is None:
        _stdin_run = _start_stdin_run()
    proc, out, err, cache = _stdin_run
    proc.wait(timeout=900)
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read(), err.read()
    assert proc.returncode == 0, stderr
    rec = json.loads(stdout.splitlines()[0])
    assert rec["prompt"] == "def fibonacci(n):" and rec["stats"]["generated_tokens"] >= 1
    # The persistent compilation cache is on by default, in $BOLE_JAX_CACHE/xla.
    assert len(os.listdir(os.path.join(cache.name, "xla"))) >= 3


def test_compile_cache_resolution(monkeypatch, tmp_path):
    import jax

    from bole_jax import compile_cache

    for k in ("BOLE_JAX_COMPILE_CACHE", "BOLE_JAX_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        _check_resolution(monkeypatch, tmp_path, compile_cache)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def _check_resolution(monkeypatch, tmp_path, compile_cache):
    home = os.path.expanduser("~")
    assert compile_cache.default_dir() == os.path.join(home, ".cache", "bole_jax", "xla")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == str(tmp_path / "xdg" / "bole_jax" / "xla")
    monkeypatch.setenv("BOLE_JAX_CACHE", str(tmp_path / "root"))
    assert compile_cache.resolve() == str(tmp_path / "root" / "xla")
    monkeypatch.setenv("BOLE_JAX_COMPILE_CACHE", str(tmp_path / "env"))
    assert compile_cache.resolve() == str(tmp_path / "env")
    assert compile_cache.resolve(tmp_path / "arg") == str(tmp_path / "arg")
    for off in ("0", "off", "none"):
        monkeypatch.setenv("BOLE_JAX_COMPILE_CACHE", off)
        assert compile_cache.resolve() is None and compile_cache.enable() is None
    assert compile_cache.resolve("none") is None and compile_cache.resolve(False) is None


def test_compile_cache_folder_is_written(monkeypatch, tmp_path):
    """LLM(compile_cache=DIR) writes the programs it compiles to DIR (a config of its own, so
    they are compiled here, not found in memory)."""
    import jax
    from jax._src import compilation_cache as jcc

    before = jax.config.jax_compilation_cache_dir
    folder = tmp_path / "xla"
    try:
        llm = LLM(ModelConfig.tiny("qwen3_5", vocab_size=300), compile_cache=folder)
        assert llm.compile_cache == str(folder)
        llm.generate([[5, 6, 7]], max_new_tokens=3, spec="ar")
        assert len(os.listdir(folder)) >= 3
    finally:
        jcc.reset_cache()
        jax.config.update("jax_compilation_cache_dir", before)


def test_commands_reserve_the_device_memory_pool_first(monkeypatch, tmp_path):
    """Every command sets XLA_PYTHON_CLIENT_MEM_FRACTION (JAX's allocator pool, 75% of a GPU by
    default) before the first device query, and a value in the environment wins."""
    assert cli.reserve_device_memory({}) == cli.XLA_POOL_FRACTION == "0.95"
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    assert (
        cli.reserve_device_memory(env) == "0.5" and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    )
    seen = []

    def enable(folder):  # the first thing after parsing that queries the backend
        seen.append(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))
        return None

    monkeypatch.setattr(cli.compile_cache, "enable", enable)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert cli.main(["generate", "--model", str(tmp_path / "nowhere"), "x"]) == 2
    assert seen and set(seen) == {"0.95"}
    seen.clear()
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.7")
    assert cli.main(["generate", "--model", str(tmp_path / "nowhere"), "x"]) == 2
    assert seen and set(seen) == {"0.7"}
