"""Tensor parallelism (bole_jax/parallel.py) on 8 simulated CPU devices.

The checks live in tests/tp_worker.py and run in subprocesses: XLA fixes the number of CPU devices
when JAX initialises, and this process already runs JAX on one. Each group compares sharded runs
with single-device runs on the same weights (greedy tokens of ar / bole / pernode / chain
identical, fp32 logits and committed caches close) for Qwen3-Next dense (tp=2), Qwen3-Next MoE
(tp=4, with the 2 KV heads replicated) and Qwen3.5 (tp=8), and runs the Pallas kernels (interpret
mode) inside shard_map. Two groups run at a time.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest

from bole_jax.serving import cli

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")
GROUPS = ("next", "moe", "q35", "pallas")
# O0 code generation: XLA:CPU compile time is mostly LLVM optimisation (4x less at O0), and each
# check compares two programs compiled with the same flags.
XLA_FLAGS = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
             "--xla_llvm_disable_expensive_passes=true")


def _run_group(group: str, tmp) -> dict:
  out = tmp / f"{group}.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + XLA_FLAGS).strip())
  proc = subprocess.run([sys.executable, WORKER, group, str(out)], env=env, capture_output=True,
                        text=True, timeout=900)
  if proc.returncode != 0 or not out.exists():
    return {"worker": dict(ok=False, detail=f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n"
                                            f"{proc.stderr[-4000:]}")}
  return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("tp")
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    futs = {g: pool.submit(_run_group, g, tmp) for g in GROUPS}
    return {g: f.result() for g, f in futs.items()}


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
