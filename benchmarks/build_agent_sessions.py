"""Build benchmarks/data/agent_sessions.jsonl: agent-style multi-turn sessions for bench_online.py.

    pip install --no-deps bfcl-eval==2026.3.23   # data + tool back-ends (pure Python; its declared
                                                 # dependencies pin numpy 1.26: do not pull them)
    python benchmarks/build_agent_sessions.py    # -> benchmarks/data/agent_sessions.jsonl

Sources (both Apache-2.0; attribution in benchmarks/data/README.md):
  bfcl        BFCL v4 `multi_turn_base` (200 sessions): a system prompt with the JSON descriptions
              of the session's tool classes (file system, trading, travel, vehicle, ...; 3.7-9.5k
              demo-tokenizer tokens, ~1.2k in compact form), user turns, and per turn the
              ground-truth tool calls (9.4 LLM calls per session on average), EXECUTED here on
              BFCL's own simulated back-ends so that every call is followed by its real output.
              An agent loop makes one LLM call per tool call (it sees the previous result before
              the next call), then one more call per turn for its answer to the user.
  spec_bench  the 80 two-turn MT-bench questions of Spec-Bench (writing, roleplay, reasoning,
              math, coding, extraction, stem, humanities): short prefixes, free-text answers.

File format: one JSON object per line, "type" says which:
  {"type": "meta", ...}                           provenance (sources, versions, licences)
  {"type": "tools", "name": CLASS, "functions": [BFCL function description, ...]}
  {"type": "session", "id", "source", "system", "tools": [CLASS, ...], "exclude": [function],
   "messages": [{"role": "user" | "assistant" | "tool", "content": str | null}, ...]}
Every assistant message is one LLM call of the replay: its prompt is the system prompt (followed
by the descriptions of `tools`, minus the `exclude`d functions) and all messages before it. A
string content is the recorded answer (a tool call), which the replay puts in the history
whatever the model generated, so that the tool outputs after it stay true; null means "no
recorded answer": the replay keeps the model's own text.
"""

from __future__ import annotations

import argparse
import ast
import collections
import copy
import importlib
import importlib.metadata
import json
import os
import random
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "data", "agent_sessions.jsonl")
SPEC_BENCH = os.path.join(HERE, "data", "spec_bench_question.jsonl")
BFCL_CATEGORY = "BFCL_v4_multi_turn_base"
TOOL_OUTPUT_CHARS = (
    2000  # longer tool outputs are cut (keeps the file small; base outputs are short)
)
SPEC_BENCH_SYSTEM = "You are a helpful assistant."


# ------------------------------------------------------------------ tool calls
def parse_call(text: str) -> tuple[str, list, dict]:
    """`name(arg, key=value, ...)` with literal arguments -> (name, args, kwargs).

    Ground-truth calls are parsed, never `eval`ed: only a plain function name and Python literals
    are accepted (ValueError otherwise)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not a call: {text!r} ({e.msg})") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {text!r}")
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except ValueError:
        raise ValueError(f"non-literal argument in {text!r}") from None
    if None in kwargs:
        raise ValueError(f"**kwargs are not supported: {text!r}")
    return node.func.id, args, kwargs


def execute_call(text: str, instances: dict[str, Any]) -> str:
    """Run one ground-truth call on the session's back-end instances; the result as BFCL shows it
    to the model (strings as is, dicts as JSON, anything else str()), errors as text."""
    try:
        name, args, kwargs = parse_call(text)
        owners = [
            inst
            for inst in instances.values()
            if not name.startswith("_") and callable(getattr(inst, name, None))
        ]
        if not owners:
            raise ValueError(f"no tool named {name!r}")
        out = getattr(owners[0], name)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a failing call is part of the trace, as in BFCL
        return f"Error during execution: {e}"
    if isinstance(out, str):
        return out
    if isinstance(out, dict):
        try:
            return json.dumps(out)
        except (TypeError, ValueError):
            return str(out)
    return str(out)


def clip(text: str, limit: int = TOOL_OUTPUT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f" ... [{len(text) - limit} chars cut]"


# ------------------------------------------------------------------ sources
def _bfcl_root() -> str:
    try:
        import bfcl_eval
    except ImportError:
        raise SystemExit(
            "error: bfcl-eval is not installed: pip install --no-deps bfcl-eval"
        ) from None
    return os.path.dirname(bfcl_eval.__file__)


def _read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def bfcl_sessions(limit: int | None = None) -> tuple[list[dict], dict[str, list[dict]]]:
    """(sessions, tool descriptions per class) from the installed bfcl-eval package."""
    from bfcl_eval.constants.default_prompts import _DEFAULT_SYSTEM_PROMPT
    from bfcl_eval.constants.executable_backend_config import (
        CLASS_FILE_PATH_MAPPING,
        MULTI_TURN_FUNC_DOC_FILE_MAPPING,
        STATELESS_CLASSES,
    )

    root = os.path.join(_bfcl_root(), "data")
    questions = _read_jsonl(os.path.join(root, f"{BFCL_CATEGORY}.json"))
    answers = {
        a["id"]: a["ground_truth"]
        for a in _read_jsonl(os.path.join(root, "possible_answer", f"{BFCL_CATEGORY}.json"))
    }
    # The tool list goes after this preamble (bench_online renders it as JSON or compactly).
    system = _DEFAULT_SYSTEM_PROMPT.split("{functions}")[0].rstrip()
    tools: dict[str, list[dict]] = {}
    sessions = []
    version = importlib.metadata.version("bfcl-eval")
    for q in questions[:limit]:
        classes = list(q["involved_classes"])
        for c in classes:
            if c not in tools:
                doc = os.path.join(root, "multi_turn_func_doc", MULTI_TURN_FUNC_DOC_FILE_MAPPING[c])
                tools[c] = _read_jsonl(doc)
        random.seed(0)  # some back-ends draw ids at random: keep the file reproducible
        instances = {}
        for c in classes:
            inst = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[c]), c)()
            if c not in STATELESS_CLASSES:
                inst._load_scenario(
                    copy.deepcopy(q["initial_config"].get(c, {})), long_context=False
                )
            instances[c] = inst
        messages = []
        for turn, calls in zip(q["question"], answers[q["id"]]):
            messages += [{"role": m["role"], "content": m["content"]} for m in turn]
            for call in calls:
                messages.append({"role": "assistant", "content": f"[{call}]"})
                messages.append({"role": "tool", "content": clip(execute_call(call, instances))})
            messages.append({"role": "assistant", "content": None})
        sessions.append(
            dict(
                type="session",
                id=f"bfcl/{q['id']}",
                source=f"bfcl-eval {version} {BFCL_CATEGORY}",
                system=system,
                tools=classes,
                exclude=list(q.get("excluded_function", [])),
                messages=messages,
            )
        )
    return sessions, tools


def spec_bench_sessions(path: str = SPEC_BENCH) -> list[dict]:
    """The multi-turn Spec-Bench questions: user turn, the model's answer, user turn, answer."""
    out = []
    for q in _read_jsonl(path):
        if len(q["turns"]) < 2:
            continue
        messages = []
        for t in q["turns"]:
            messages += [{"role": "user", "content": t}, {"role": "assistant", "content": None}]
        out.append(
            dict(
                type="session",
                id=f"spec_bench/{q['question_id']}",
                source=f"Spec-Bench question.jsonl ({q['category']})",
                system=SPEC_BENCH_SYSTEM,
                tools=[],
                exclude=[],
                messages=messages,
            )
        )
    return out


def build(
    out: str = DEFAULT_OUT, bfcl_limit: int | None = None, spec_bench: str = SPEC_BENCH
) -> dict:
    sessions, tools = bfcl_sessions(bfcl_limit)
    sessions += spec_bench_sessions(spec_bench)
    meta = dict(
        type="meta",
        built_by="benchmarks/build_agent_sessions.py",
        sources={
            "bfcl": f"PyPI bfcl-eval {importlib.metadata.version('bfcl-eval')}, "
            f"bfcl_eval/data/{BFCL_CATEGORY}.json + possible_answer + "
            "multi_turn_func_doc (Apache-2.0)",
            "spec_bench": "github hemingkx/Spec-Bench data/spec_bench/question.jsonl, "
            "commit fd2c1cd, two-turn questions (Apache-2.0)",
        },
        tool_output_chars=TOOL_OUTPUT_CHARS,
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for rec in [meta] + [
            dict(type="tools", name=k, functions=v) for k, v in sorted(tools.items())
        ]:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        for s in sessions:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    calls = collections.Counter(
        s["id"].split("/")[0] for s in sessions for m in s["messages"] if m["role"] == "assistant"
    )
    errors = sum(
        m["content"].startswith("Error during execution")
        for s in sessions
        for m in s["messages"]
        if m["role"] == "tool"
    )
    return dict(
        path=out,
        bytes=os.path.getsize(out),
        sessions=len(sessions),
        llm_calls=dict(calls),
        tool_classes=len(tools),
        tool_errors=errors,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--bfcl-limit", type=int, default=None, help="first N BFCL sessions only")
    ap.add_argument("--spec-bench", default=SPEC_BENCH, help="Spec-Bench question.jsonl")
    a = ap.parse_args(argv)
    print(json.dumps(build(a.out, a.bfcl_limit, a.spec_bench), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
