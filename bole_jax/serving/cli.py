"""`bole-jax` command line (also `python -m bole_jax`).

  bole-jax generate "def fibonacci(n):"                     # embedded demo model
  bole-jax generate --model DIR --file prompts.jsonl --output out.jsonl --json
  bole-jax serve --model DIR --port 8000                    # OpenAI-compatible server
  echo "hello" | bole-jax generate --max-tokens 32 --temperature 0.8 --top-p 0.95
  bole-jax calibrate --model DIR                             # fastest mode per batch bucket
  bole-jax bench --preset qwen3.5-9b --out DIR              # ar / bole / pernode / chain
  bole-jax draft-vocab --model DIR corpus/                  # token counts for --draft-vocab

Every command keeps compiled programs in JAX's persistent compilation cache (--compile-cache,
default $BOLE_JAX_CACHE/xla or ~/.cache/bole_jax/xla; BOLE_JAX_COMPILE_CACHE=DIR moves it, =0
turns it off), so the second run of a command skips most compilation.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from bole_jax import compile_cache

SPEC_CHOICES = ("ar", "bole", "pernode", "chain")
BENCH_MODES = (*SPEC_CHOICES, "bole-chain", "engine")
# bole-chain: the chain shape (k = 1, N = depth + 1) verified by bole; engine: the default choice
# (the calibration table's)
XLA_CACHE = compile_cache.flag_default()  # persistent compilation cache of every command


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows "(default: X)" after every option whose help does not already state its default
    (options whose default is None say in words what happens when they are absent)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" in text.lower()
            or action.default is None
            or action.default is argparse.SUPPRESS
        ):
            return text
        return super()._get_help_string(action)


def version() -> str:
    """The installed distribution's version, else the package's own (a source checkout)."""
    from importlib import metadata

    try:
        return metadata.version("bole-jax")
    except metadata.PackageNotFoundError:
        from bole_jax import __version__

        return __version__


class _Alias(argparse.Action):
    """Stores into `dest` and into every name of `also` (old spellings read by code not yet
    renamed); as a hidden alias (help=SUPPRESS) it just forwards to the main option's dest."""

    def __init__(self, option_strings, dest, also=(), **kw):
        self.also = tuple(also)
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        for d in (self.dest,) + self.also:
            setattr(namespace, d, values)


def add_batch_size_arg(ap, default: int, help: str, also: tuple[str, ...] = ()) -> None:
    """--max-batch-size (LLM's max_batch_size); --batch-size and --max-batch stay as hidden
    aliases. `also`: extra namespace names given the same value (e.g. "max_batch")."""
    ap.add_argument(
        "--max-batch-size", type=int, default=default, action=_Alias, also=also, help=help
    )
    ap.add_argument(
        "--batch-size",
        "--max-batch",
        type=int,
        dest="max_batch_size",
        default=argparse.SUPPRESS,
        action=_Alias,
        also=also,
        help=argparse.SUPPRESS,
    )
    if also:
        ap.set_defaults(**{d: default for d in also})


def add_tree_args(ap) -> None:
    """Tree shape of the speculative modes (LLM(spec_options=...), spec_decode/step.py SpecConfig);
    read them back with `spec_options_from_args`."""
    g = ap.add_argument_group("draft tree (bole / pernode / chain)")
    g.add_argument(
        "--tree-nodes",
        type=int,
        default=None,
        metavar="N",
        help="verified tree nodes per request (default: the calibration table at this "
        "batch bucket, else a safe default: about 256 nodes per step over the batch, "
        "4-64 per request)",
    )
    g.add_argument(
        "--tree-topk",
        type=int,
        default=None,
        metavar="K",
        help="children tried per node (default: 4; chain mode uses 1)",
    )
    g.add_argument(
        "--tree-depth",
        type=int,
        default=None,
        metavar="D",
        help="draft depth, tokens proposed past the root (default: 8)",
    )
    g.add_argument(
        "--tree-budget",
        type=int,
        default=None,
        metavar="K",
        help="total verified nodes per step across the batch, shared by the requests' "
        "best-scored drafts (default: the calibration table, else N per request)",
    )
    g.add_argument(
        "--calibration",
        default=None,
        metavar="TABLE",
        help="calibration table of `bole-jax calibrate` (default: the model folder's "
        "bole_calibration.json, then the user cache)",
    )


def spec_options_from_args(args) -> dict | None:
    """`LLM(spec_options=...)` from the flags of `add_tree_args` (None when none was given)."""
    opts = {
        k: getattr(args, a, None)
        for k, a in (
            ("num_nodes", "tree_nodes"),
            ("topk", "tree_topk"),
            ("depth", "tree_depth"),
            ("budget", "tree_budget"),
            ("calibration", "calibration"),
        )
    }
    opts = {k: v for k, v in opts.items() if v is not None}
    for k in ("num_nodes", "topk", "depth", "budget"):
        if k in opts and opts[k] < 1:
            raise ValueError(
                f"--tree-{'nodes' if k == 'num_nodes' else k} must be >= 1, got {opts[k]}"
            )
    return opts or None


def add_compile_cache_arg(ap) -> None:
    ap.add_argument(
        "--compile-cache",
        default=XLA_CACHE,
        metavar="DIR",
        help="persistent XLA compilation cache folder, 'none' = off (env "
        "BOLE_JAX_COMPILE_CACHE=DIR or 0; default: %(default)s)",
    )


def _read_prompts(args) -> list[tuple[str, dict]]:
    """(prompt, the other fields of its JSONL object, passed through to the output) per prompt."""
    prompts = [(p, {}) for p in args.prompts]
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
                        raise SystemExit(
                            f"error: {args.file}:{n}: expected a string or an object with a "
                            "'prompt' string"
                        )
                    extra = (
                        {k: v for k, v in obj.items() if k != "prompt"}
                        if isinstance(obj, dict)
                        else {}
                    )
                    prompts.append((p, extra))
        else:
            prompts += [(line, {}) for line in text.splitlines() if line.strip()]
    if not prompts and not sys.stdin.isatty():
        prompts += [(line, {}) for line in sys.stdin.read().splitlines() if line.strip()]
    if not prompts:
        raise SystemExit("error: no prompts: pass them as arguments, with --file, or on stdin")
    return prompts


def _cmd_generate(args) -> int:
    from bole_jax.llm import LLM

    prompts = _read_prompts(args)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        tp=args.tp,
        draft_vocab=args.draft_vocab,
        spec_options=spec_options_from_args(args),
        compile_cache=args.compile_cache,
    )
    outs = llm.generate(
        [p for p, _ in prompts],
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or None,
        spec=args.spec,
        progress=not args.no_progress,
    )
    # The input's other JSONL fields (e.g. "id") first, so that an output field of the same name
    # wins over them.
    records = [
        {
            **extra,
            **dict(
                prompt=p,
                text=o.text,
                token_ids=o.token_ids,
                finish_reason=o.finish_reason,
                stats=o.stats,
            ),
        }
        for (p, extra), o in zip(prompts, outs)
    ]
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    if args.json:  # JSON lines: one object per prompt, in prompt order
        for r in records:
            print(json.dumps(r))
    elif not args.output:
        for r in records:
            print(r["prompt"] + r["text"])
            s = r["stats"]
            print(
                f"--- [{s['mode']}] {s['generated_tokens']} tokens, {s['steps']} steps, "
                f"{s['tokens_per_s']:.1f} tok/s, finish={r['finish_reason']}",
                file=sys.stderr,
            )
    return 0


def _cmd_serve(args) -> int:
    import logging

    from bole_jax.serving.server import serve

    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("bole_jax").setLevel(logging.INFO)
    tp = {}
    opts = spec_options_from_args(args)
    if args.simulate_accept_mean is not None:  # p follows from the depth each mode drafts
        opts = {**(opts or {}), "simulate_accept_mean": args.simulate_accept_mean}
    served_model_name = args.served_model_name
    build = None  # the server builds its own LLM otherwise
    if args.preset is not None:
        from bole_jax.serving.simulate import preset_llm

        build, source = preset_llm, args.preset
        served_model_name = served_model_name or f"random-{args.preset}"
    elif args.tp != 1 or opts or args.draft_vocab:
        from bole_jax.llm import LLM

        build, source = LLM, args.model
    if build is not None:
        tp = dict(
            llm=build(
                source,
                dtype=args.dtype,
                tp=args.tp,
                spec_options=opts or None,
                draft_vocab=args.draft_vocab,
            )
        )
    from bole_jax.serving.protocol import Limits

    try:
        limits = Limits(
            max_body_bytes=int(args.max_body_mb * 2**20),
            max_prompt_chars=args.max_prompt_chars,
            max_prompts=args.max_prompts,
            max_n=args.max_n,
            max_stops=args.max_stops,
            max_stop_chars=args.max_stop_chars,
            max_tokens=args.max_tokens,
            default_max_tokens=args.default_max_tokens,
            max_messages=args.max_messages,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keep_alive_s=args.keep_alive,
            shutdown_grace_s=args.shutdown_grace,
        )
        serve(
            args.model,
            spec=args.spec,
            host=args.host,
            port=args.port,
            max_batch=args.max_batch,
            max_context=args.max_context,
            dtype=args.dtype,
            segment_steps=args.segment_steps,
            segment_ms=args.segment_ms or None,
            served_model_name=served_model_name,
            prefill_chunk=args.prefill_chunk,
            prefix_block=args.prefix_block,
            prefix_cache_gb=args.prefix_cache_gb,
            prefix_checkpoints=args.prefix_checkpoints,
            memory_gb=args.memory_gb,
            limits=limits,
            api_key=args.api_key or os.environ.get("BOLE_JAX_API_KEY"),
            allow_special_tokens=args.allow_special_tokens,
            backlog=args.backlog,
            max_logprobs=args.max_logprobs,
            slot_group=args.slot_group or None,
            **tp,
        )
    except OSError as e:  # e.g. the port is taken
        print(f"error: cannot serve on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


def _cmd_calibrate(args) -> int:
    import jax

    from bole_jax.measure import calibrate
    from bole_jax.spec_decode import budget

    if args.timings_from is not None:
        if args.preset is None or args.model is not None or args.prompts_file is not None:
            raise SystemExit(
                "bole-jax calibrate: --timings-from re-weighs a --preset table (synthetic "
                "drafter) at --accept-mean; a checkpoint's acceptance is measured"
            )
        try:
            old = budget.load_table(args.timings_from)
            table = calibrate.rescore_synthetic(old, args.accept_mean, args.timings_from)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"bole-jax calibrate: {args.timings_from}: {e}") from None
        from bole_jax.model import parallel
        from bole_jax.model.presets import preset

        cfg = preset(args.preset, mtp=True, tp=parallel.check_tp(args.tp))
        want = calibrate.model_signature(cfg, table["model"].get("param_dtype", "bfloat16"))
        if want != table["model"]:
            raise SystemExit(
                f"bole-jax calibrate: {args.timings_from} was measured on another model than "
                f"--preset {args.preset}"
            )
        print(calibrate.format_table(table))
        print(f"wrote {calibrate.store(table, args.out, merge=False)}")
        return 0
    cpu = jax.default_backend() == "cpu"
    batches = args.batch or ([1] if cpu else list(calibrate.DEFAULT_BATCHES))
    nodes = args.nodes or list(calibrate.CPU_NODES if cpu else calibrate.DEFAULT_NODES)
    calibrate.check_calibration_args(batches, nodes, args.depth, steps=args.steps, warm=args.warm)
    calibrate.check_contexts(args.context or ())
    if min(args.topk) < 1:
        raise SystemExit(f"bole-jax calibrate: --topk must be >= 1, got {args.topk}")
    if args.out is not None:
        budget.check_writable_location(args.out)
    from bole_jax.llm import LLM

    p, prompts = None, None
    if args.prompts_file is not None:
        if args.preset is not None:
            raise SystemExit(
                "bole-jax calibrate: --prompts-file needs a checkpoint (--model): the synthetic "
                "drafter of --preset accepts independently of the prompts"
            )
        from bole_jax.measure.bench import load_prompts

        try:
            prompts = load_prompts(args.prompts_file)
        except (OSError, ValueError) as e:
            raise SystemExit(f"bole-jax calibrate: {e}") from None
    if args.preset is None:  # a checkpoint folder, else the embedded demo model
        llm = LLM(args.model, dtype=args.dtype, tp=args.tp, draft_vocab=args.draft_vocab)
    else:
        from bole_jax.model import parallel
        from bole_jax.model.presets import peaked_lm_head, preset

        cfg = preset(args.preset, mtp=True, tp=parallel.check_tp(args.tp))
        params = peaked_lm_head(
            # bf16 matmuls are emulated on CPU: float32 there, as `bole-jax bench` (whose
            # --calibration then finds this table) and the LLM's CPU default
            parallel.init_params(
                cfg, jax.random.key(0), args.dtype or ("float32" if cpu else "bfloat16")
            ),
            cfg,
        )
        p = calibrate.synthetic_accept_prob(args.accept_mean, max(args.depth))
        llm = LLM(
            cfg, params=params, spec_options=dict(synthetic_accept=p), draft_vocab=args.draft_vocab
        )
    import logging

    # the calibration's phase lines (prefill, compilation, each bucket timed), bar or no bar
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("bole_jax.calibrate").setLevel(logging.INFO)
    if cpu:
        print(
            "calibrating on CPU: the tree kernels run as references (interpret mode), so the "
            "choice is the CPU's, not a GPU's",
            file=sys.stderr,
        )
    table = calibrate.calibrate(
        llm,
        batches,
        nodes,
        args.depth,
        topk=args.topk,
        modes=args.modes,
        accept_prob=p,
        steps=args.steps,
        repeats=args.repeats,
        warm=args.warm,
        backend=args.backend,
        workers=args.compile_workers,
        time_budget=args.time_budget,
        progress=not args.no_progress,
        prompts=prompts,
        prompts_source=args.prompts_file,
        contexts=args.context or (),
    )
    print(calibrate.format_table(table))
    print(f"wrote {calibrate.store(table, args.out, merge=not args.no_merge)}")
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
    src.add_argument(
        "--preset",
        help="random-weight model dims with the synthetic-acceptance "
        "drafter (default qwen3.5-9b; see bole_jax/model/presets.py, or tiny)",
    )
    src.add_argument(
        "--model",
        help="local Hugging Face folder (with an MTP head): MTP drafter (default: --preset)",
    )
    ap.add_argument(
        "--prompts-file",
        help="with --model: .jsonl with 'prompt' (HumanEval) or "
        "'turns' (Spec-Bench), .jsonl.gz, or one prompt per line (default: random "
        "prompts of --prompt-len tokens)",
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        default=list(BENCH_MODES),
        choices=BENCH_MODES,
        help="decoding modes timed",
    )
    ap.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=None,
        help="batch sizes (default: 1 4 16 32 64; with --quick: 1)",
    )
    ap.add_argument(
        "--prompt-len",
        type=int,
        default=128,
        help="random prompt tokens (presets) / max prompt tokens kept (--model)",
    )
    ap.add_argument(
        "--context",
        type=int,
        default=None,
        help="KV capacity per request, a power of two: the prompt, then filler rows that "
        "attention reads like real context, then the generation (default: prompt + generation)",
    )
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per point")
    ap.add_argument("--warm", type=int, default=3, help="warm-up decode steps per point")
    ap.add_argument("--topk", type=int, default=4, help="tree: children tried per node")
    ap.add_argument("--depth", type=int, default=8, help="tree: draft depth")
    ap.add_argument(
        "--nodes",
        default="auto",
        help="tree width N per request, or 'auto': calibration table / safe default",
    )
    ap.add_argument(
        "--budget",
        default="auto",
        help="total verified nodes per batch: an int, 'none', or 'auto' (with the table)",
    )
    ap.add_argument("--calibration", help="calibration table (default: the usual locations)")
    ap.add_argument(
        "--accept-mean",
        type=float,
        default=6.4,
        help="synthetic drafter: target mean tokens per step (sets p)",
    )
    ap.add_argument(
        "--accept-prob",
        type=float,
        help="synthetic drafter: p itself (default: from --accept-mean)",
    )
    ap.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "pallas", "reference"],
        help="tree kernels: pallas, the jnp reference, or auto (pallas on GPU)",
    )
    ap.add_argument(
        "--lazy-commit",
        action="store_true",
        help="bole: the commit keeps the step's factors and accepted path, whose rows "
        "the next verify folds into the state (default: rebuild each GDN state in the "
        "commit); run both to compare them",
    )
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="weights dtype (default: bfloat16 for presets (float32 on CPU), the "
        "checkpoint's for --model)",
    )
    ap.add_argument(
        "--breakdown-batch",
        type=int,
        default=None,
        help="batch whose step is split into stages (nearest run batch; 0 = off; "
        "default: 16, with --quick: off)",
    )
    ap.add_argument(
        "--breakdown-modes",
        nargs="+",
        choices=BENCH_MODES[1:],
        help="spec modes whose step is split (default: all run)",
    )
    ap.add_argument("--breakdown-reps", type=int, default=5, help="timed repeats per stage")
    ap.add_argument(
        "--profile-loop",
        type=int,
        default=0,
        metavar="STEPS",
        help="once every point is timed, trace STEPS steps of each point's jitted loop, "
        "from its timed window's context (on a GPU a twin compiled without CUDA command "
        "buffers, so that every kernel keeps its stage) and split them by stage, with each "
        "stage's bytes floor; the idle row closes the timed step (0 = off)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: short timing windows, batch 1, no breakdown, a 75 s "
        "time budget (each unless given)",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds from the start (setup, prefill and compilation count); "
        "programs not compiled by 80%% of it and points not started by then are "
        "skipped (default: 480, with --quick: 75)",
    )
    ap.add_argument(
        "--compile-workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="threads compiling programs ahead of their points",
    )
    add_compile_cache_arg(ap)
    ap.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="let EOS end requests (default: ignore EOS, full batches throughout)",
    )
    ap.add_argument(
        "--prompt-sets",
        type=int,
        default=1,
        help="with --model: time each batch on up to this many disjoint sets of the prompts "
        "and pool them (B = 1 then measures several requests, not only the file's first; "
        "default: %(default)s, the first B prompts)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every mode R times, the modes interleaved round by round, and report each "
        "row's median round with every round's step time and its ratio to AR's in the same "
        "round (a device's drift between runs reaches every mode alike; default: %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=0, help="random weights, prompts and sampling")
    add_draft_vocab_arg(ap)
    add_tp_arg(ap)
    ap.add_argument("--out", default="benchmarks/results/e2e", help="folder for JSON and plots")
    ap.add_argument("--no-plots", action="store_true", help="write the JSON only")


def add_draft_vocab_arg(ap) -> None:
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="the MTP drafter scores only the N most frequent tokens (the model "
        "folder's draft_vocab.json, else the first N ids): a cheaper draft, lossless "
        "(default: the whole vocabulary)",
    )


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
        model, counts, source=f"{len(files)} files under {' '.join(args.text)}"
    )
    order = draft_vocab.frequency_order(counts)
    total = max(int(counts.sum()), 1)
    print(f"wrote {path}: {int(counts.sum())} tokens counted over {len(files)} files")
    for n in (1024, 4096, 16384, 32768, 65536):
        if n < cfg.vocab_size:
            print(
                f"  top {n:>6} tokens cover {counts[order[:n]].sum() / total:.2%} of the counted text"
            )
    return 0


def add_tp_arg(ap) -> None:
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel devices: weights, caches and kernels split over the first "
        "TP devices of this host (docs/parallel.md)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bole-jax",
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n", 1)[1],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = functools.partial(sub.add_parser, formatter_class=HelpFormatter)
    g = sp(
        "generate",
        help="offline batch generation",
        description="Generate continuations of prompts (arguments, --file, or stdin lines).",
    )
    g.add_argument("prompts", nargs="*", help="prompt strings (default: --file, else stdin lines)")
    g.add_argument(
        "--model", default=None, help="local Hugging Face folder (default: embedded demo)"
    )
    g.add_argument(
        "--file",
        help="prompts file: one per line, or .jsonl of strings or objects "
        "with a 'prompt' field (their other fields, e.g. 'id', are copied to the "
        "output records) (default: none)",
    )
    g.add_argument(
        "--output", help="write the records as JSON lines to this file (default: print the texts)"
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="print the records as JSON lines, one object per prompt (default: the "
        "prompt and its text, stats on stderr)",
    )
    g.add_argument(
        "--max-tokens",
        "--max-new-tokens",
        dest="max_tokens",
        type=int,
        default=64,
        help="new tokens per prompt, at most",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus mass, 1 = off (measured after top-k)"
    )
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed: each prompt gets the same sample whatever --max-batch-size",
    )
    g.add_argument(
        "--stop",
        action="append",
        help="stop string, repeatable (default: EOS and --max-tokens only)",
    )
    g.add_argument(
        "--spec",
        default=None,
        choices=SPEC_CHOICES,
        help="decoding mode (default: the fastest measured for this model and batch by `bole-jax calibrate`, else ar)",
    )
    g.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="weights dtype (default: float32 on CPU, else the checkpoint's)",
    )
    add_batch_size_arg(g, 64, "requests decoded together; more prompts run in several batches")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_tree_args(g)
    add_draft_vocab_arg(g)
    add_tp_arg(g)
    add_compile_cache_arg(g)
    g.set_defaults(func=_cmd_generate)
    s = sp("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    src = s.add_mutually_exclusive_group()
    src.add_argument(
        "--model", default=None, help="local Hugging Face folder (default: embedded demo)"
    )
    src.add_argument(
        "--preset",
        default=None,
        help="benchmarks: random weights with a published model's dimensions "
        "(bole_jax/model/presets.py, or tiny) behind the demo model's tokenizer; outputs "
        "are not a model's (docs/serving.md) (default: --model)",
    )
    s.add_argument(
        "--simulate-accept-mean",
        type=float,
        default=None,
        metavar="X",
        help="benchmarks: the speculative modes accept X tokens per step on average "
        "(each next depth of a drafted path with the probability that gives X) "
        "whatever the target says; outputs are then simulated, not the model's "
        "(default: the real, lossless acceptance)",
    )
    s.add_argument(
        "--spec",
        default=None,
        choices=["ar", "bole", "pernode", "chain"],
        help="decoding mode (default: the fastest measured for this model and batch by `bole-jax calibrate`, else ar)",
    )
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    add_batch_size_arg(
        s,
        8,
        "decode slots (requests decoded together); capped by device memory",
        also=("max_batch",),
    )
    s.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="prompt + max_tokens limit per request (sets the KV capacity per slot; "
        "default: the model's max_position_embeddings)",
    )
    s.add_argument(
        "--segment-steps",
        type=int,
        default=8,
        help="decode steps per jitted segment, at most (requests join/leave between segments)",
    )
    s.add_argument(
        "--segment-ms",
        type=float,
        default=100.0,
        help="target duration of a decode segment: the steps per segment adapt to the "
        "measured step time so that a cancel or a new request waits about this long at "
        "most (0 = always --segment-steps)",
    )
    s.add_argument(
        "--slot-group",
        type=int,
        default=0,
        help="split the slots into decode groups of this many rows, each its own compiled step: "
        "an iteration runs only the groups holding a request (lowest free slot first), so the "
        "step's work follows the running requests rather than the slots (0 = one group: the "
        "whole batch in one step)",
    )
    add_tree_args(s)
    s.add_argument(
        "--served-model-name", default=None, help="model id in the API (default: folder name)"
    )
    s.add_argument(
        "--prefill-chunk",
        type=int,
        default=1024,
        help="prompt tokens prefilled between two decode segments, at most (rounded up to "
        "whole --prefix-block pieces): long prompts are prefilled over several iterations "
        "while the running requests keep streaming",
    )
    s.add_argument(
        "--prefix-block",
        type=int,
        default=256,
        help="prefix-cache block in tokens, also the prefill piece: the recurrent state can "
        "be resumed at the end of a block (see --prefix-checkpoints)",
    )
    s.add_argument(
        "--prefix-checkpoints",
        choices=("sparse", "every"),  # prefix_cache.CHECKPOINT_POLICIES (imports jax)
        default="sparse",
        help="which cached blocks keep a recurrent-state checkpoint (on Qwen3.5 models about "
        "10x a block's KV): 'sparse' (default) at each prompt's last full block and at branch "
        "points, 'every' at every block (nothing recomputed, the most memory)",
    )
    s.add_argument(
        "--prefix-cache-gb",
        type=float,
        default=None,
        help="prefix cache budget in GiB (0 = off; default: the memory the slots leave, "
        "1 GiB when the backend reports none)",
    )
    s.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="cap in GiB on what the decode slots and the prefix cache may use (e.g. to "
        "make admission and eviction bind on a small model); see /metrics bole_memory_* "
        "(default: no cap)",
    )
    s.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="weights dtype (default: float32 on CPU, else the checkpoint's)",
    )
    h = s.add_argument_group("HTTP limits (docs/serving.md)")
    h.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $BOLE_JAX_API_KEY, else none)",
    )
    h.add_argument(
        "--allow-special-tokens",
        action="store_true",
        help="take special-token text in chat message contents as control tokens "
        "(default: as plain text, so clients cannot forge roles)",
    )
    h.add_argument("--max-body-mb", type=float, default=32.0, help="request body cap (413 beyond)")
    h.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="characters of a prompt (or of a chat's messages), checked before "
        "tokenising (default: 8 x max context, at least 4096)",
    )
    h.add_argument("--max-prompts", type=int, default=64, help="prompts per completion request")
    h.add_argument("--max-n", type=int, default=16, help="choices per prompt (n)")
    h.add_argument("--max-stops", type=int, default=16, help="stop strings per request")
    h.add_argument("--max-stop-chars", type=int, default=256, help="characters per stop string")
    h.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="largest max_tokens a request may ask for (default: the max context)",
    )
    h.add_argument(
        "--default-max-tokens",
        type=int,
        default=4096,
        help="max_tokens of a request that gives none (capped by the context left)",
    )
    h.add_argument("--max-messages", type=int, default=1024, help="messages per chat request")
    h.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        help="seconds a connection has to send a whole request head",
    )
    h.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the next piece of a request body (408 after)",
    )
    h.add_argument(
        "--keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open",
    )
    h.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests may go on before they are "
        "ended (finish_reason length)",
    )
    h.add_argument("--backlog", type=int, default=2048, help="listen backlog")
    s.add_argument(
        "--max-logprobs",
        type=int,
        default=None,
        help="record target logprobs of every generated token and up to K top "
        "alternatives per token (0-20; requests may ask for logprobs / top_logprobs up "
        "to K); default off: it costs a log-softmax and top-k over the vocabulary per "
        "verified position",
    )
    add_draft_vocab_arg(s)
    add_tp_arg(s)
    add_compile_cache_arg(s)
    s.set_defaults(func=_cmd_serve)

    c = sp(
        "calibrate",
        help="measure ar / chain / bole step times and acceptance "
        "on this model and store the choice per batch bucket (docs/budget.md)",
    )
    src = c.add_mutually_exclusive_group()
    src.add_argument("--model", help="local Hugging Face folder (default: the embedded demo model)")
    src.add_argument(
        "--preset",
        help="random-weight model dims with the synthetic drafter "
        "(bole_jax/model/presets.py) instead of a checkpoint (default: the checkpoint)",
    )
    c.add_argument(
        "--out",
        help="table path (default: the user cache, $BOLE_JAX_CACHE/"
        "calibration or $XDG_CACHE_HOME/bole_jax/calibration, keyed by model, device "
        "and jax version; never inside the package)",
    )
    c.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=None,
        help="batch buckets (default: 1 4 16 64; on CPU: 1)",
    )
    c.add_argument(
        "--nodes",
        type=int,
        nargs="+",
        default=None,
        help="bole tree widths N (default: 4 8 16 32 64; on CPU: 4 8)",
    )
    c.add_argument(
        "--depth", type=int, nargs="+", default=[8], help="draft depths (chain and bole)"
    )
    c.add_argument(
        "--context",
        type=int,
        nargs="+",
        default=None,
        metavar="L",
        help="also time every batch bucket with each request's KV cache filled to L tokens (a "
        "power of two, e.g. 16384): the engine then chooses at the context it decodes at "
        "(generate: prompt + max_new_tokens; serve: --max-context), where a tree that wins at "
        "short contexts can lose to ar (default: the calibration's own short context only)",
    )
    c.add_argument(
        "--topk",
        type=int,
        nargs="+",
        default=[4],
        help="bole trees: children per node, one or several values (each width is timed with "
        "each; the bole chain, one child per node, is always timed)",
    )
    c.add_argument(
        "--timings-from",
        metavar="TABLE",
        help="with --preset: re-weigh TABLE (a synthetic-drafter table of the same dims) at "
        "--accept-mean, keeping its step times (they do not depend on the synthetic acceptance), "
        "instead of timing again (default: the candidates are timed)",
    )
    c.add_argument(
        "--prompts-file",
        help="the texts the acceptance is measured on, like the workload's: .jsonl with "
        "'prompt' (HumanEval) or 'turns' (Spec-Bench), .jsonl.gz, or one prompt per line "
        "(default: short built-in prose and code prompts)",
    )
    c.add_argument(
        "--modes",
        nargs="+",
        default=["ar", "chain", "bole"],
        choices=["ar", "chain", "bole"],
        help="modes timed (ar is always needed)",
    )
    c.add_argument("--steps", type=int, default=8, help="timed decode steps per window")
    c.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed windows per candidate (step time: the fastest window's)",
    )
    c.add_argument("--warm", type=int, default=2, help="untimed decode steps per candidate")
    c.add_argument(
        "--accept-mean",
        type=float,
        default=3.5,
        help="--preset: the synthetic drafter's mean tokens per step at the largest depth",
    )
    c.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "pallas", "reference"],
        help="tree kernels: pallas, the jnp reference, or auto (pallas on GPU)",
    )
    c.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="weights dtype (default: bfloat16 for presets (float32 on CPU), the checkpoint's "
        "for --model)",
    )
    c.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds; candidates not compiled by then are skipped (default: none)",
    )
    c.add_argument(
        "--compile-workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="programs compiled at once (threads)",
    )
    add_compile_cache_arg(c)
    c.add_argument(
        "--no-merge",
        action="store_true",
        help="replace the stored table (default: keep its buckets this run does not time)",
    )
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_draft_vocab_arg(c)
    add_tp_arg(c)
    c.set_defaults(func=_cmd_calibrate)
    b = sp("bench", help="offline decode throughput: ar / bole / pernode / chain")
    add_bench_args(b)
    b.set_defaults(func=_cmd_bench)
    d = sp(
        "draft-vocab",
        help="count token frequencies over text files and write the "
        "model folder's draft_vocab.json (for --draft-vocab)",
    )
    d.add_argument("text", nargs="+", help="text files or folders (.py .txt .rst .md)")
    d.add_argument(
        "--model", default=None, help="local Hugging Face folder (default: embedded demo)"
    )
    d.add_argument("--max-mb", type=float, default=64.0, help="text read, at most (MiB)")
    add_compile_cache_arg(d)
    d.set_defaults(func=_cmd_draft_vocab)
    return p


# JAX's GPU allocator reserves 75% of the device by default (XLA_PYTHON_CLIENT_MEM_FRACTION);
# what the model's weights leave of that pool is what the server plans its slots and prefix cache
# in. The commands reserve 95% (as the capacity runs in docs/benchmarks.md section 3 did): on an
# 80 GB H100 under a 27B model that is 21.9 GiB usable instead of 7.65, 46 bole slots instead of
# 15 (docs/benchmarks.md section 3). A value in the environment wins.
XLA_POOL_FRACTION = "0.95"


def reserve_device_memory(environ=os.environ) -> str:
    """Set XLA_PYTHON_CLIENT_MEM_FRACTION to XLA_POOL_FRACTION unless the environment gives one;
    must run before JAX starts its backend. Returns the fraction in force."""
    return environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", XLA_POOL_FRACTION)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    reserve_device_memory()  # before the first device query (compile_cache.enable makes one)
    # Before anything compiles: on for every command (calibrate / bench read the folder back).
    args.compile_cache = compile_cache.enable(args.compile_cache) or "none"
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
