"""Tensor parallelism (bole_jax/model/parallel.py) on 8 simulated CPU devices.

The checks live in tests/tp_worker.py and run in subprocesses: XLA fixes the number of CPU devices
when JAX initialises, and this process already runs JAX on one. Each group compares sharded runs
with single-device runs on the same weights (greedy tokens of ar / bole / pernode / chain
identical, fp32 logits and committed caches close) for Qwen3-Next dense (tp=2, with the Pallas
kernels in interpret mode inside shard_map), Qwen3-Next MoE (tp=4, with the 2 KV heads
replicated) and Qwen3.5 (tp=8).

The workers start right after collection (conftest.py calls `start_background`), at low CPU
priority: the rest of the suite mostly keeps one of CI's two cores busy (XLA compiles are
single-threaded), so they run on the other one, and the test below only collects their results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import start_niced

from bole_jax.serving import cli

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tp_worker.py")
# Two worker processes of about the same length (the groups of one run one after the other).
WORKERS = (("next",), ("moe", "q35"))
GROUPS = tuple(g for w in WORKERS for g in w)
# O0 code generation: XLA:CPU compile time is mostly LLVM optimisation (4x less at O0), and each
# check compares two programs compiled with the same flags.
XLA_FLAGS = (
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
)
TIMEOUT_S = 1800  # per worker, from its start (it may share the CPU with the whole suite)
_workers: list | None = None  # [(groups, Popen, log file, out folder, started)]


def start_background(names: set[str]) -> None:
    """Start the worker processes (at nice 10) when the sharded-vs-single test is selected."""
    global _workers
    if _workers is not None or "test_sharded_equals_single_device" not in names:
        return
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + XLA_FLAGS).strip(),
    )
    _workers = []
    for groups in WORKERS:
        out = tempfile.mkdtemp(prefix="bole-tp-")
        log = open(os.path.join(out, "log.txt"), "w+")
        proc = start_niced(
            [sys.executable, WORKER, out, *groups],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        _workers.append((groups, proc, log, out, time.monotonic()))


def stop_background() -> None:
    """End the workers still running (a session stopped early) and remove their files."""
    global _workers
    import shutil

    for _, proc, log, out, _ in _workers or ():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(out, ignore_errors=True)
    _workers = None


def _collect(groups, proc, log, out, started) -> dict:
    try:
        proc.wait(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    res = {}
    for g in groups:
        path = os.path.join(out, f"{g}.json")
        if os.path.exists(path):
            with open(path) as f:
                res[g] = json.load(f)
    if proc.returncode != 0 or len(res) != len(groups):
        log.seek(0)
        text = log.read()
        for g in groups:
            res.setdefault(
                g, {"worker": dict(ok=False, detail=f"exit {proc.returncode}\n{text[-6000:]}")}
            )
    return res


@pytest.fixture(scope="module")
def results():
    if _workers is None:  # not started by conftest (e.g. pytest -p no:... or another runner)
        start_background({"test_sharded_equals_single_device"})
    res = {}
    for w in _workers:
        res.update(_collect(*w))
    return res


@pytest.mark.parametrize("group", GROUPS)
def test_sharded_equals_single_device(results, group):
    res = results[group]
    failed = {k: v["detail"] for k, v in res.items() if not v["ok"]}
    assert not failed, "\n\n".join(f"[{group}/{k}]\n{d}" for k, d in failed.items())
    assert res, f"group {group} ran no checks"


def test_cli_tp_flag(capsys):
    """--tp is accepted by generate / serve / calibrate / bench, and more devices than exist is a
    clear error (this process sees one CPU device)."""
    p = cli.build_parser()
    for argv in (["generate", "x"], ["serve"], ["calibrate"], ["bench"]):
        assert p.parse_args(argv + ["--tp", "2"]).tp == 2
        assert p.parse_args(argv).tp == 1
    assert cli.main(["generate", "hello", "--tp", "64", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "tp=64 needs 64 devices" in err and "--tp" in err
