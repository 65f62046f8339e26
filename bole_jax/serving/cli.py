"""`bole-jax` command line (also `python -m bole_jax`).

  bole-jax generate "def fibonacci(n):"                     # embedded demo model
  bole-jax generate --model DIR --file prompts.txt --output out.jsonl --json
  echo "hello" | bole-jax generate --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys


def _read_prompts(args) -> list[str]:
  prompts = list(args.prompts)
  if args.file:
    try:
      with open(args.file, encoding="utf-8") as f:
        text = f.read()
    except OSError as e:
      raise SystemExit(f"error: cannot read --file {args.file}: {e.strerror}")
    if args.file.endswith(".jsonl"):
      for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
          try:
            obj = json.loads(line)
          except json.JSONDecodeError as e:
            raise SystemExit(f"error: {args.file}:{n}: invalid JSON ({e.msg})")
          p = obj.get("prompt") if isinstance(obj, dict) else obj
          if not isinstance(p, str):
            raise SystemExit(f"error: {args.file}:{n}: expected a string or an object with a "
                             "'prompt' string")
          prompts.append(p)
    else:
      prompts += [line for line in text.splitlines() if line.strip()]
  if not prompts and not sys.stdin.isatty():
    prompts += [line for line in sys.stdin.read().splitlines() if line.strip()]
  if not prompts:
    raise SystemExit("error: no prompts: pass them as arguments, with --file, or on stdin")
  return prompts


def _cmd_generate(args) -> int:
  from bole_jax.llm import LLM

  prompts = _read_prompts(args)
  llm = LLM(args.model, dtype=args.dtype, max_batch_size=args.batch_size)
  outs = llm.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop or None,
                      spec=args.spec, progress=not args.no_progress)
  records = [dict(prompt=p, text=o.text, token_ids=o.token_ids, finish_reason=o.finish_reason,
                  stats=o.stats) for p, o in zip(prompts, outs)]
  if args.output:
    with open(args.output, "w", encoding="utf-8") as f:
      for r in records:
        f.write(json.dumps(r) + "\n")
  if args.json:
    print(json.dumps(records, indent=1))
  elif not args.output:
    for r in records:
      print(r["prompt"] + r["text"])
      s = r["stats"]
      print(f"--- [{s['mode']}] {s['generated_tokens']} tokens, {s['steps']} steps, "
            f"{s['tokens_per_s']:.1f} tok/s, finish={r['finish_reason']}", file=sys.stderr)
  return 0


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="bole-jax", description=__doc__.split("\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  g = sub.add_parser("generate", help="offline batch generation")
  g.add_argument("prompts", nargs="*", help="prompt strings (else --file or stdin)")
  g.add_argument("--model", default=None, help="local Hugging Face folder (default: embedded demo)")
  g.add_argument("--file", help="prompts file: one per line, or .jsonl with a 'prompt' field")
  g.add_argument("--output", help="write results as jsonl here")
  g.add_argument("--json", action="store_true", help="print machine-readable results")
  g.add_argument("--max-new-tokens", type=int, default=64)
  g.add_argument("--temperature", type=float, default=0.0)
  g.add_argument("--top-p", type=float, default=1.0)
  g.add_argument("--top-k", type=int, default=0)
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--stop", action="append", help="stop string (repeatable)")
  g.add_argument("--spec", default=None, help="decoding mode: ar (default for now)")
  g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
  g.add_argument("--batch-size", type=int, default=64, help="max requests decoded together")
  g.add_argument("--no-progress", action="store_true")
  g.set_defaults(func=_cmd_generate)
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
