"""`bole-jax` command line (also `python -m bole_jax`).

  bole-jax generate "def fibonacci(n):"                     # embedded demo model
  bole-jax generate --model DIR --file prompts.txt --output out.jsonl --json
  bole-jax serve --model DIR --port 8000                    # OpenAI-compatible server
  echo "hello" | bole-jax generate --max-new-tokens 32
  bole-jax calibrate --preset qwen3.5-9b --out table.json   # verify budget per batch bucket
  bole-jax bench --preset qwen3.5-9b --out DIR              # ar / bole / pernode / chain
  bole-jax draft-vocab --model DIR corpus/                  # token counts for --draft-vocab
"""

from __future__ import annotations

import argparse
import json
import os
import sys


BENCH_MODES = ("ar", "bole", "pernode", "chain")
XLA_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                         "bole_jax", "xla")  # persistent compilation cache of calibrate / bench


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
  llm = LLM(args.model, dtype=args.dtype, max_batch_size=args.batch_size, tp=args.tp,
            draft_vocab=args.draft_vocab)
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


def _cmd_serve(args) -> int:
  import logging

  from bole_jax.serving.server import serve

  logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
  logging.getLogger("bole_jax").setLevel(logging.INFO)
  tp = {}
  opts = {k: v for k, v in (("num_nodes", args.tree_nodes), ("calibration", args.calibration))
          if v is not None}
  if args.tp != 1 or opts or args.draft_vocab:  # the server builds its own LLM otherwise
    from bole_jax.llm import LLM

    tp = dict(llm=LLM(args.model, dtype=args.dtype, tp=args.tp, spec_options=opts or None,
                      draft_vocab=args.draft_vocab))
  try:
    serve(args.model, spec=args.spec, host=args.host, port=args.port, max_batch=args.max_batch,
          max_context=args.max_context, dtype=args.dtype, segment_steps=args.segment_steps,
          served_model_name=args.served_model_name, prefill_chunk=args.prefill_chunk,
          prefix_block=args.prefix_block, prefix_cache_gb=args.prefix_cache_gb,
          memory_gb=args.memory_gb, **tp)
  except OSError as e:  # e.g. the port is taken
    print(f"error: cannot serve on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
    return 2
  return 0


def _cmd_calibrate(args) -> int:
  from pathlib import Path

  from bole_jax.measure import calibrate
  from bole_jax.measure.env import enable_compile_cache
  from bole_jax.spec_decode import budget

  calibrate.check_calibration_args(args.batch, args.nodes, args.kv, args.eps, mode=args.mode,
                                repeats=args.repeats)
  if args.compile_cache and args.compile_cache.lower() != "none":
    enable_compile_cache(args.compile_cache)
  if args.model is not None:
    from bole_jax.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, tp=args.tp)
    cfg, params = llm.cfg, llm.params
  else:
    import jax

    from bole_jax import parallel
    from bole_jax.model.presets import preset

    cfg = preset(args.preset or "qwen3.5-9b", mtp=False, tp=parallel.check_tp(args.tp))
    parallel.log_layout(cfg)
    params = parallel.init_params(cfg, jax.random.key(0), args.dtype or "bfloat16")
  table = calibrate.calibrate((cfg, params), args.batch, args.nodes, args.kv, args.eps,
                           mode=args.mode, topk=args.topk, depth=args.depth,
                           backend=args.backend, repeats=args.repeats,
                           early_stop=not args.no_early_stop, workers=args.compile_workers,
                           progress=not args.no_progress)
  out = args.out
  if out is None:
    out = (Path(args.model) / budget.CALIBRATION_FILE if args.model is not None else
           budget.default_table_dir() / f"{args.preset or 'qwen3.5-9b'}_"
           f"{table['device'].replace(' ', '_')}.json")
  if args.merge and Path(out).is_file():
    table = calibrate.merge_tables(budget.load_table(out), table)
  print(calibrate.format_table(table))
  print(f"wrote {calibrate.save_table(table, out)}")
  return 0


def _cmd_bench(args) -> int:
  from bole_jax.measure import bench

  result = bench.run_e2e(args)
  if result["compiles_pending"]:  # do not wait for compilations of skipped points
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
  return 0


def add_bench_args(ap) -> None:
  """Options of `bole-jax bench` and benchmarks/bench_e2e.py (run by `bench.run_e2e`)."""
  src = ap.add_mutually_exclusive_group()
  src.add_argument("--preset", help="random-weight model dims with the synthetic-acceptance "
                   "drafter (default qwen3.5-9b; see bole_jax/model/presets.py, or tiny)")
  src.add_argument("--model", help="local Hugging Face folder (with an MTP head): MTP drafter")
  ap.add_argument("--prompts-file", help="with --model: .jsonl with 'prompt' (HumanEval) or "
                  "'turns' (Spec-Bench), .jsonl.gz, or one prompt per line")
  ap.add_argument("--modes", nargs="+", default=list(BENCH_MODES), choices=BENCH_MODES)
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32, 64])
  ap.add_argument("--prompt-len", type=int, default=128,
                  help="random prompt tokens (presets) / max prompt tokens kept (--model)")
  ap.add_argument("--steps", type=int, default=24, help="timed decode steps per point")
  ap.add_argument("--warm", type=int, default=3, help="warm-up decode steps per point")
  ap.add_argument("--topk", type=int, default=4)
  ap.add_argument("--depth", type=int, default=8)
  ap.add_argument("--nodes", default="auto",
                  help="tree width N per request, or 'auto': calibration table / safe default")
  ap.add_argument("--budget", default="auto",
                  help="total verified nodes per batch: an int, 'none', or 'auto' (with the table)")
  ap.add_argument("--calibration", help="calibration table (default: the usual locations)")
  ap.add_argument("--accept-mean", type=float, default=6.4,
                  help="synthetic drafter: target mean tokens per step (sets p)")
  ap.add_argument("--accept-prob", type=float, help="synthetic drafter: p itself")
  ap.add_argument("--backend", default="auto", choices=["auto", "pallas", "reference"])
  ap.add_argument("--lazy-commit", action="store_true",
                  help="bole: the commit keeps the step's factors and accepted path, whose rows "
                  "the next verify folds into the state (default: rebuild each GDN state in the "
                  "commit); run both to compare them")
  ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                  help="weights dtype (default: bfloat16 for presets, the checkpoint's for "
                  "--model)")
  ap.add_argument("--breakdown-batch", type=int, default=16,
                  help="batch whose step is split into stages (nearest run batch; 0 = off)")
  ap.add_argument("--breakdown-modes", nargs="+", choices=BENCH_MODES[1:],
                  help="spec modes whose step is split (default: all run)")
  ap.add_argument("--breakdown-reps", type=int, default=5)
  ap.add_argument("--profile-loop", type=int, default=0, metavar="STEPS",
                  help="after each point's timed window, trace STEPS more steps of its jitted "
                  "loop and split them by stage, with each stage's bytes floor (0 = off)")
  ap.add_argument("--quick", action="store_true", help="short timing windows (smoke runs)")
  ap.add_argument("--time-budget", type=float, default=480.0,
                  help="seconds from the start (setup, prefill and compilation count); "
                  "programs not compiled by 80%% of it and points not started by then are "
                  "skipped")
  ap.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1),
                  help="threads compiling programs ahead of their points")
  ap.add_argument("--compile-cache", default=XLA_CACHE,
                  help="persistent XLA compilation cache folder ('none' = off)")
  ap.add_argument("--stop-at-eos", action="store_true",
                  help="let EOS end requests (default: ignore EOS, full batches throughout)")
  ap.add_argument("--seed", type=int, default=0)
  add_draft_vocab_arg(ap)
  add_tp_arg(ap)
  ap.add_argument("--out", default="benchmarks/results/e2e", help="folder for JSON and plots")
  ap.add_argument("--no-plots", action="store_true")


def add_draft_vocab_arg(ap) -> None:
  ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                  help="the MTP drafter scores only the N most frequent tokens (the model "
                  "folder's draft_vocab.json, else the first N ids): a cheaper draft, lossless "
                  "(default: the whole vocabulary)")


def _cmd_draft_vocab(args) -> int:
  from pathlib import Path

  from bole_jax.llm import DEFAULT_MODEL_DIR, Tokenizer
  from bole_jax.model.config import ModelConfig
  from bole_jax.spec_decode import draft_vocab
  from bole_jax.train.corpus import corpus_files, iter_documents

  model = Path(args.model) if args.model else DEFAULT_MODEL_DIR
  if not (model / "tokenizer.json").is_file():
    raise FileNotFoundError(f"{model} has no tokenizer.json: cannot count tokens")
  cfg = ModelConfig.from_pretrained(model)
  tok = Tokenizer(model / "tokenizer.json")
  files = corpus_files([Path(t) for t in args.text])
  if not files:
    raise ValueError(f"no text files (.py .txt .rst .md) under {args.text}")
  docs = iter_documents(files, max_bytes=int(args.max_mb * 2**20))
  counts = draft_vocab.token_frequencies((tok.encode(d) for d in docs), cfg.vocab_size)
  path = draft_vocab.write_draft_vocab(
      model, counts, source=f"{len(files)} files under {' '.join(args.text)}")
  order = draft_vocab.frequency_order(counts)
  total = max(int(counts.sum()), 1)
  print(f"wrote {path}: {int(counts.sum())} tokens counted over {len(files)} files")
  for n in (1024, 4096, 16384, 32768, 65536):
    if n < cfg.vocab_size:
      print(f"  top {n:>6} tokens cover {counts[order[:n]].sum() / total:.2%} of the counted text")
  return 0


def add_tp_arg(ap) -> None:
  ap.add_argument("--tp", type=int, default=1,
                  help="tensor-parallel devices: weights, caches and kernels split over the first "
                  "TP devices of this host (docs/parallel.md)")


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
  add_draft_vocab_arg(g)
  add_tp_arg(g)
  g.set_defaults(func=_cmd_generate)
  s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
  s.add_argument("--model", default=None, help="local Hugging Face folder (default: embedded demo)")
  s.add_argument("--spec", default=None, choices=["ar", "bole", "pernode", "chain"],
                 help="decoding mode (default: bole when the model has an MTP head, else ar)")
  s.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
  s.add_argument("--port", type=int, default=8000)
  s.add_argument("--max-batch", type=int, default=8,
                 help="decode slots (requests decoded together); capped by device memory")
  s.add_argument("--max-context", type=int, default=None,
                 help="prompt + max_tokens limit per request (sets the KV capacity per slot)")
  s.add_argument("--segment-steps", type=int, default=8,
                 help="decode steps per jitted segment (requests join/leave between segments)")
  s.add_argument("--tree-nodes", type=int, default=None,
                 help="draft tree width per request (default: the calibration table at "
                      "--max-batch, else a safe default)")
  s.add_argument("--calibration", default=None, help="calibration table (bole-jax calibrate)")
  s.add_argument("--served-model-name", default=None, help="model id in the API (default: folder name)")
  s.add_argument("--prefill-chunk", type=int, default=1024,
                 help="prompt tokens prefilled between two decode segments, at most (rounded up to "
                 "whole --prefix-block pieces): long prompts are prefilled over several iterations "
                 "while the running requests keep streaming")
  s.add_argument("--prefix-block", type=int, default=256,
                 help="prefix-cache block in tokens, also the prefill piece: the recurrent state is "
                 "checkpointed after every full block")
  s.add_argument("--prefix-cache-gb", type=float, default=None,
                 help="prefix cache budget in GiB (0 = off; default: the memory the slots leave, "
                 "1 GiB when the backend reports none)")
  s.add_argument("--memory-gb", type=float, default=None,
                 help="cap in GiB on what the decode slots and the prefix cache may use (e.g. to "
                 "make admission and eviction bind on a small model); see /metrics bole_memory_*")
  s.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
  add_draft_vocab_arg(s)
  add_tp_arg(s)
  s.set_defaults(func=_cmd_serve)

  c = sub.add_parser("calibrate", help="time tree verify vs decode and write the budget table")
  src = c.add_mutually_exclusive_group()
  src.add_argument("--model", help="local Hugging Face folder (table default: DIR/"
                   "bole_calibration.json)")
  src.add_argument("--preset", help="random-weight model dims (default qwen3.5-9b)")
  c.add_argument("--out", help="table path (default: next to the model, or the user cache)")
  c.add_argument("--eps", type=float, default=0.1,
                 help="B_ver = max N with T_ver(N) <= (1 + eps) T_dec")
  c.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32, 64])
  c.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
  c.add_argument("--kv", type=int, nargs="+", default=[1024], help="KV capacity buckets")
  c.add_argument("--mode", default="bole", choices=["bole", "pernode", "chain"])
  c.add_argument("--topk", type=int, default=4)
  c.add_argument("--depth", type=int, default=8)
  c.add_argument("--backend", default="auto", choices=["auto", "pallas", "reference"])
  c.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
  c.add_argument("--repeats", type=int, default=10)
  c.add_argument("--compile-workers", type=int, default=8,
                 help="programs compiled at once (threads) before each timing wave")
  c.add_argument("--compile-cache", default=XLA_CACHE,
                 help="persistent XLA compilation cache folder ('none' = off)")
  c.add_argument("--no-early-stop", action="store_true", help="time every node bucket")
  c.add_argument("--merge", action="store_true",
                 help="keep the buckets of an existing --out table that this run does not time")
  c.add_argument("--no-progress", action="store_true")
  add_tp_arg(c)
  c.set_defaults(func=_cmd_calibrate)
  b = sub.add_parser("bench", help="offline decode throughput: ar / bole / pernode / chain")
  add_bench_args(b)
  b.set_defaults(func=_cmd_bench)
  d = sub.add_parser("draft-vocab", help="count token frequencies over text files and write the "
                     "model folder's draft_vocab.json (for --draft-vocab)")
  d.add_argument("text", nargs="+", help="text files or folders (.py .txt .rst .md)")
  d.add_argument("--model", default=None, help="local Hugging Face folder (default: embedded demo)")
  d.add_argument("--max-mb", type=float, default=64.0, help="text read, at most (MiB)")
  d.set_defaults(func=_cmd_draft_vocab)
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
