"""Shared test setup: repo on sys.path, fp32 JAX on CPU, no `fla`, tiny HF checkpoint fixtures."""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The user cache (calibration tables, compiled programs) belongs to the user: a table there would
# change the engine's default mode under the tests. One fresh folder per test session instead
# (subprocesses inherit it); BOLE_JAX_TESTS_KEEP_CACHE=1 keeps the caller's.
if not os.environ.get("BOLE_JAX_TESTS_KEEP_CACHE"):
    os.environ["BOLE_JAX_CACHE"] = tempfile.mkdtemp(prefix="bole_jax_test_cache_")

# The tests are compile-bound (tiny shapes), and XLA:CPU compile time is mostly LLVM optimisation:
# O0 code generation compiles about a third faster. Set before JAX creates its CPU client;
# subprocesses (CLI, tensor-parallel workers) inherit it; flags the caller set come after, so win.
os.environ["XLA_FLAGS"] = (
    "--xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true " + os.environ.get("XLA_FLAGS", "")
).strip()

# The fresh random inputs of the kernel tests: one seed per test run, drawn here and shared by
# every process of the run (pytest-xdist workers inherit the variable, so they collect the same
# test ids); BOLE_JAX_TESTS_SEED=N repeats a run's inputs (the seed is in the test ids).
os.environ.setdefault("BOLE_JAX_TESTS_SEED", str(int.from_bytes(os.urandom(4), "little")))
RUN_SEED = int(os.environ["BOLE_JAX_TESTS_SEED"])

import jax  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

jax.config.update("jax_enable_x64", False)
# The reference models are tiny: torch's intra-op threads only add overhead (10x per step here).
torch.set_num_threads(1)

# With flash-linear-attention installed transformers silently switches the GDN reference to
# Triton kernels with other numerics: parity against it would not mean what it says.
assert importlib.util.find_spec("fla") is None, (
    "uninstall flash-linear-attention (`fla`) to run the parity tests"
)

from hf_tiny import load_torch_model, make_tiny_hf_checkpoint  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop JAX's caches of compiled programs. Every XLA:CPU executable
    keeps a few memory mappings alive while cached, and one pytest process running the whole
    suite reached the kernel's per-process limit (vm.max_map_count, 65530) in its last module:
    `mmap` failed with ENOMEM (in test_weights.py, once as a segfault inside an XLA
    compile). One module's tests share their compiles; across modules little is reused."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory fixture: tiny_checkpoint(family, moe=False, seed=0, **overrides) -> (path, torch model).

    Cached per argument set for the whole session, so test files share the checkpoints."""
    cache = {}

    def make(family="qwen3_next", moe=False, seed=0, **overrides):
        key = (family, moe, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            tmp = tmp_path_factory.mktemp(f"{family}_{'moe' if moe else 'dense'}_{seed}")
            path = make_tiny_hf_checkpoint(tmp, family, moe, seed, **overrides)
            cache[key] = (path, load_torch_model(path))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny model folder (MTP head, EOS 0) with the package's tokenizer (vocab 8192) and chat
    template: what the CLI, LLM and server tests load through the real loading path."""
    import shutil

    from bole_jax.llm import DEFAULT_MODEL_DIR
    from bole_jax.model import ModelConfig, init_params
    from bole_jax.model.weights import save_hf_checkpoint

    d = tmp_path_factory.mktemp("tiny_model")
    cfg = ModelConfig.tiny("qwen3_next", vocab_size=8192, mtp_num_layers=1, eos_token_ids=(0,))
    save_hf_checkpoint(d, cfg, init_params(cfg, jax.random.key(0), "float32"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / f, d / f)
    return d


# Test modules with slow subprocess checks define start_background(names) / stop_background():
# the subprocesses start right after collection (only for the selected tests `names`) and run at
# low CPU priority (`start_niced`) alongside the rest of the suite, which mostly keeps one core
# busy (XLA compiles are single-threaded); the tests then only wait for their results.
_background_modules = []


def start_niced(args, **kwargs) -> subprocess.Popen:
    """subprocess.Popen, then nice 10 for the child (set right after exec, before the interpreter
    starts threads: on Linux the value is per thread, and new threads inherit it)."""
    proc = subprocess.Popen(args, **kwargs)
    try:
        os.setpriority(os.PRIO_PROCESS, proc.pid, 10)
    except (AttributeError, OSError):  # not POSIX, or already gone: normal priority
        pass
    return proc


def wait_until_healthy(proc, url: str, log, timeout: float, poll: float = 0.25) -> None:
    """Wait for a `bole-jax serve` child to answer /health with 200; fail with its log when it
    exits first or does not answer within `timeout` seconds."""
    import time
    import urllib.request

    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(poll)
    proc.kill()
    pytest.fail("the server did not start:\n" + log.read_text())


def pytest_report_header(config):
    return f"BOLE_JAX_TESTS_SEED={RUN_SEED}"


def pytest_collection_finish(session):
    # Under pytest-xdist every worker collects every test but runs only some: the tests start
    # their subprocesses themselves when they run (each background module has that fallback).
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    selected = {}
    for item in session.items:
        mod = getattr(item, "module", None)
        if mod is not None and hasattr(mod, "start_background"):
            selected.setdefault(mod, set()).add(getattr(item, "originalname", item.name))
    for mod, names in selected.items():
        _background_modules.append(mod)
        mod.start_background(names)


def pytest_sessionfinish(session, exitstatus):
    for mod in _background_modules:
        mod.stop_background()
