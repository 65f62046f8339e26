"""The generation API and the command line: outputs, stops, errors, no recompilation."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bole_jax import LLM, ModelConfig
from bole_jax.serving import cli

REPO = Path(__file__).resolve().parents[1]


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
  llm.generate(["a b c"], max_new_tokens=8, spec="ar")
  seg = llm.segment_fn("ar")
  before = seg._cache_size()
  llm.generate(["x y"], max_new_tokens=8, spec="ar", temperature=0.7, top_p=0.9, seed=3)
  llm.generate(["p", "q r"], max_new_tokens=8, spec="ar")
  assert seg._cache_size() == before


def test_stop_string_and_max_tokens(llm):
  base = llm.generate(["import os"], max_new_tokens=12, spec="ar")[0]
  text = base.text
  assert len(text) > 3
  stop = text[2:4]
  out = llm.generate(["import os"], max_new_tokens=12, spec="ar", stop=[stop])[0]
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
  """`python -m bole_jax generate` reading stdin, on the embedded default model."""
  r = subprocess.run([sys.executable, "-m", "bole_jax", "generate", "--max-new-tokens", "4",
                      "--no-progress", "--json", "--spec", "ar"], input="def fibonacci(n):\n",
                     capture_output=True, text=True, cwd=REPO, timeout=600)
  assert r.returncode == 0, r.stderr
  rec = json.loads(r.stdout)[0]
  assert rec["prompt"] == "def fibonacci(n):" and rec["stats"]["generated_tokens"] >= 1
