"""The generation API and the command line: outputs, stops, errors, no recompilation."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import start_niced

from bole_jax import LLM, ModelConfig
from bole_jax.serving import cli

REPO = Path(__file__).resolve().parents[2]
_stdin_run = None  # (Popen, stdout file, stderr file) of test_cli_stdin_subprocess_default_model


def _start_stdin_run():
  """`python -m bole_jax generate` on the embedded default model, the prompt on stdin."""
  out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
  proc = start_niced([sys.executable, "-m", "bole_jax", "generate", "--max-new-tokens", "4",
                      "--no-progress", "--json", "--spec", "ar"], stdin=subprocess.PIPE,
                     stdout=out, stderr=err, text=True, cwd=REPO)
  proc.stdin.write("def fibonacci(n):\n")
  proc.stdin.close()
  return proc, out, err


def start_background(names):
  """Called by conftest.py right after collection: the subprocess test runs meanwhile."""
  global _stdin_run
  if "test_cli_stdin_subprocess_default_model" in names and _stdin_run is None:
    _stdin_run = _start_stdin_run()


def stop_background():
  global _stdin_run
  if _stdin_run is not None:
    proc, out, err = _stdin_run
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    out.close()
    err.close()
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
  jits shared by every LLM)."""
  from bole_jax.spec_decode import loop

  llm.generate(["a b c"], max_new_tokens=8, spec="ar")
  llm.generate(["p", "q r"], max_new_tokens=8, spec="ar")
  programs = [llm.segment_fn("ar", 1), llm.segment_fn("ar", 2), loop.prefill_chunk,
              loop.first_token]
  before = [f._cache_size() for f in programs]
  assert min(before) >= 1
  llm.generate(["x y"], max_new_tokens=8, spec="ar", temperature=0.7, top_p=0.9, seed=3)
  llm.generate(["def", "q r s"], max_new_tokens=8, spec="ar", top_k=5, temperature=1.0)
  assert [f._cache_size() for f in programs] == before


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


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop=[""]), "stop"),
    (dict(spec="medusa"), "unknown spec mode"), (dict(max_context=3), "maximum context"),
])
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
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + json.dumps("print(") + "\n")
  out = tmp_path / "out.jsonl"
  rc = cli.main(["generate", "--model", str(model_dir), "--file", str(prompts), "--output",
                 str(out), "--json", "--max-new-tokens", "5", "--no-progress", "--spec", "bole"])
  assert rc == 0
  printed = json.loads(capsys.readouterr().out)
  lines = [json.loads(x) for x in out.read_text().splitlines()]
  assert [r["prompt"] for r in lines] == ["def f(x):", "print("]
  assert printed == lines
  assert all(r["stats"]["mode"] == "bole" for r in lines)


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
  proc, out, err = _stdin_run
  proc.wait(timeout=900)
  out.seek(0)
  err.seek(0)
  stdout, stderr = out.read(), err.read()
  assert proc.returncode == 0, stderr
  rec = json.loads(stdout)[0]
  assert rec["prompt"] == "def fibonacci(n):" and rec["stats"]["generated_tokens"] >= 1
