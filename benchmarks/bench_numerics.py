"""Teacher-forced numerics of every mode against AR: logit error, argmax flips, state drift.

    python benchmarks/bench_numerics.py --batch 16 --steps 10 --out DIR

AR decodes greedily; each variant then replays AR's tokens (every step verifies a tree whose root
path is AR's next depth + 1 tokens, with random distractor nodes beside it, and commits that
path whatever the logits say) and is compared with AR at every position
(`bole_jax.measure.numerics`). Unlike greedy agreement, which ends at a request's first flip,
every position of every request counts, so a few hundred tokens separate variants whose
difference is a fraction of the bf16 noise.

Variants are `MODE[:KEY=VALUE,...]` (`numerics.parse_variant`): modes chunk (AR's own forward
over the path at once: the noise floor of computing the same function in another order), chain,
pernode, bole; keys `backend` and the KernelOptions fields. Off the GPU, a bole variant left on
backend "auto" runs the Pallas verify in interpret mode with the device's roundings emulated
(`interpret_numerics=device`: its bf16 operands, its TF32 dots), unless --no-emulate; the other
modes and `bole:backend=reference` run their fp32 jnp references there.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bole_jax.measure import numerics  # noqa: E402
from bole_jax.measure.bench import load_prompts, print_table, write_json  # noqa: E402
from bole_jax.measure.env import environment  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_VARIANTS = (
    "ar",
    "chunk",
    "chain",
    "pernode",
    "bole:backend=reference",
    "bole",
    "bole:tree_gdn_state=tf32",
    "bole:tree_gdn_bf16=0",
    "bole:tree_gdn_bf16=0,tree_gdn_state=fp32",
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model",
        default=None,
        help="checkpoint folder (default: the embedded demo model, unless --preset is given)",
    )
    ap.add_argument(
        "--preset",
        default=None,
        help="random weights at a preset's dimensions (presets.peaked_lm_head) and random "
        "prompts instead of a checkpoint (default: none)",
    )
    ap.add_argument(
        "--prompts-file",
        default=os.path.join(HERE, "data", "humaneval_prompts.jsonl"),
        help="prompts for a checkpoint (default: benchmarks/data/humaneval_prompts.jsonl)",
    )
    ap.add_argument(
        "--prompt-len", type=int, default=128, help="tokens kept per prompt (default: 128)"
    )
    ap.add_argument("--batch", type=int, default=16, help="requests (default: 16)")
    ap.add_argument(
        "--steps",
        type=int,
        default=10,
        help="forced steps per variant; AR decodes 1 + steps x (depth + 1) tokens (default: 10)",
    )
    ap.add_argument("--depth", type=int, default=8, help="draft depth (default: 8)")
    ap.add_argument(
        "--nodes",
        type=int,
        default=32,
        help="tree nodes for pernode and bole, the path and random distractors (default: 32)",
    )
    ap.add_argument(
        "--dtype", default="bfloat16", help="weights and activations (default: bfloat16)"
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=list(DEFAULT_VARIANTS),
        help="MODE[:KEY=VALUE,...] (default: %(default)s)",
    )
    ap.add_argument(
        "--no-emulate",
        action="store_true",
        help="off the GPU, run bole variants on backend auto (the fp32 reference) instead of "
        "the interpret-mode kernel with the device's roundings (default: emulate)",
    )
    ap.add_argument(
        "--reference-dtype",
        default=None,
        help="run the AR reference in this dtype (e.g. float32) while the variants run in "
        "--dtype; variant ar then shows AR's own distance from it (default: --dtype)",
    )
    ap.add_argument("--seed", type=int, default=0, help="distractor trees (default: 0)")
    ap.add_argument("--out", default=None, help="folder for numerics_<model>.json (default: none)")
    a = ap.parse_args(argv)
    if a.model is not None and a.preset is not None:
        ap.error("--model and --preset exclude each other")
    for name in ("prompt_len", "batch", "steps", "depth", "nodes"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    try:
        a.variant_objs = [numerics.parse_variant(v) for v in a.variants]
    except ValueError as e:
        ap.error(str(e))
    return a


def emulated(v: numerics.Variant) -> numerics.Variant:
    """A bole variant on backend auto, off the GPU: the interpret-mode kernel with the device's
    roundings (module docstring)."""
    if v.mode != "bole" or v.backend != "auto" or jax.default_backend() == "gpu":
        return v
    kernels = dataclasses.replace(v.kernels, interpret_numerics="device")
    return numerics.Variant(v.mode, "pallas", kernels)


def load(a):
    """(cfg, params, prompt token ids, model name)."""
    from bole_jax.llm import LLM
    from bole_jax.measure.calibrate import prompt_token_ids

    if a.preset is not None:
        from bole_jax.model import init_params
        from bole_jax.model.presets import peaked_lm_head, preset

        cfg = preset(a.preset)
        params = peaked_lm_head(init_params(cfg, jax.random.key(a.seed), a.dtype), cfg)
        rng = np.random.default_rng(a.seed)
        ids = rng.integers(0, cfg.vocab_size, (a.batch, a.prompt_len)).tolist()
        return cfg, params, ids, a.preset
    llm = LLM(a.model, dtype=a.dtype)
    prompts = load_prompts(a.prompts_file)
    ids = prompt_token_ids(llm.tokenizer, prompts, a.prompt_len)[: a.batch]
    if len(ids) < a.batch:
        raise SystemExit(f"{a.prompts_file}: {len(ids)} prompts, --batch {a.batch} needs more")
    name = os.path.basename(os.path.normpath(a.model)) if a.model else "default_model"
    return llm.cfg, llm.params, ids, name


def main(argv=None):
    a = parse_args(argv)
    env = environment()
    variants = a.variant_objs if a.no_emulate else [emulated(v) for v in a.variant_objs]
    cfg, params, ids, name = load(a)
    ref_params = None
    if a.reference_dtype not in (None, a.dtype):
        ref_params = jax.tree.map(
            lambda x: x.astype(a.reference_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            params,
        )
    t0 = time.perf_counter()
    result = numerics.teacher_forced(
        params,
        cfg,
        ids,
        variants,
        steps=a.steps,
        depth=a.depth,
        nodes=a.nodes,
        seed=a.seed,
        ref_params=ref_params,
        log=lambda s: print(f"[{time.perf_counter() - t0:6.1f} s] {s}", flush=True),
    )
    rows = []
    for r in result["variants"]:
        gaps = r["flip_gaps"]
        rows.append(
            dict(
                variant=r["variant"],
                positions=r["positions"],
                max_abs_err=f"{r['max_abs_err']:.3g}",
                mean_abs_err=f"{r['mean_abs_err']:.3g}",
                margin_err_mean=f"{r['margin_err_mean']:.3g}",
                margin_err_p99=f"{r['margin_err_p99']:.3g}",
                flips=r["flips"],
                flip_rate=f"{r['flip_rate']:.4f}",
                largest_gap_flipped=f"{max(gaps):.3g}" if gaps else "-",
                state_rel_err=f"{r['state_rel_err']:.3g}",
            )
        )
    ar = result["ar"]
    print(
        f"\n{name}, {a.dtype} against AR in {ar['dtype']}, {env['device']}: B = {ar['batch']}, {ar['positions']} positions "
        f"per variant; AR top-2 gaps below 0.01 / 0.03 / 0.1 / 0.3 at "
        + " / ".join(str(v) for v in ar["near_ties"].values())
        + " positions"
    )
    table = print_table(rows, list(rows[0]))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, f"numerics_{name}.json")
        write_json(
            path,
            dict(
                command="python " + " ".join(sys.argv if argv is None else [__file__, *argv]),
                env=env,
                model=name,
                dtype=a.dtype,
                reference_dtype=a.reference_dtype or a.dtype,
                batch=a.batch,
                steps=a.steps,
                depth=a.depth,
                nodes=a.nodes,
                wall_s=time.perf_counter() - t0,
                result=result,
                table=table,
            ),
        )
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
