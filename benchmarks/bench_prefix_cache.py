"""Prefix-cache replay: how many prompt tokens the cache spares under each checkpoint policy.

    python benchmarks/bench_prefix_cache.py --preset qwen3.5-27b --budgets-gb 1 2 4 8 \
        --concurrency 8 20 --out benchmarks/results/prefix_cache

The agent sessions of bench_online.py (benchmarks/data/agent_sessions.jsonl: BFCL multi-turn tool
use and Spec-Bench two-turn chats; the system prompt with its tool descriptions rendered as
bench_online renders it) are turned into the token ids of every call, with the demo model's
tokenizer and chat template, as `bole-jax serve --preset` sees them (an answer without a recorded
one is a fixed pseudo-random text of --max-tokens tokens). The calls then go through the server's
prefix-cache index (`serving/prefix_cache.py`: `store_prompt`, over the `resume` / `store` the
scheduler calls) with entries of the preset's real sizes (its attention and MTP KV per block, its
GDN checkpoint) under a byte budget, for each policy (`--prefix-checkpoints`): `C` sessions are in
flight at a time, each sending its next call in turn (round robin), a finished session replaced by
the next one in a seeded order. No device memory is allocated (the entries are zero-stride views
of their size): the result is what the index decides, not a timing.

Per (policy, budget, concurrency): the share of prompt tokens resumed from the cache (the prefill
the cache spares), the calls that resumed anything, and the checkpoints and bytes held at the end.
Prints a table and writes prefix_cache.json (command, git commit, jax version).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_online import DEFAULT_SESSIONS, load_sessions  # noqa: E402

from bole_jax.llm import DEFAULT_MODEL_DIR, Tokenizer  # noqa: E402
from bole_jax.measure.bench import print_table, write_json  # noqa: E402
from bole_jax.measure.env import environment  # noqa: E402
from bole_jax.model.presets import preset  # noqa: E402
from bole_jax.serving.chat import ChatTemplate  # noqa: E402
from bole_jax.serving.prefix_cache import (  # noqa: E402
    CHECKPOINT_POLICIES,
    PrefixBlock,
    PrefixCache,
    block_bytes,
    checkpoint_bytes,
)

GiB = 2**30
COLS = (
    "policy",
    "budget_gb",
    "concurrency",
    "calls",
    "prompt_tokens",
    "resumed_fraction",
    "calls_resumed",
    "entries",
    "checkpoints",
    "checkpoints_dropped",
    "evicted",
    "held_gb",
)


def session_calls(
    sessions, tokenizer, template, max_tokens: int, max_context: int, seed: int
) -> list[list]:
    """Per session, the prompt token ids of each of its calls (the history so far, as bench_online
    sends it); a call whose prompt leaves no room for max_tokens in max_context ends its session
    (the server refuses it)."""
    rng = np.random.default_rng(seed)
    vocab = 8000  # ids below the demo vocabulary's special tokens
    out = []
    for s in sessions:
        history, calls = [], []
        for m in s.messages:
            if m["role"] != "assistant":
                history.append({"role": m["role"], "content": m["content"]})
                continue
            msgs = [{"role": "system", "content": s.system}] + history
            ids = tokenizer.encode(template.render(msgs))
            if len(ids) + max_tokens > max_context:
                break
            calls.append(ids)
            text = m["content"]
            if text is None:
                text = tokenizer.decode(rng.integers(100, vocab, max_tokens).tolist())
            history.append({"role": "assistant", "content": text})
        if calls:
            out.append(calls)
    return out


def _zeros(nbytes: int) -> np.ndarray:
    return np.broadcast_to(np.zeros((), np.uint8), (nbytes,))  # nbytes of it, no memory


def replay(calls, policy: str, budget: int, concurrency: int, block: int, kv_bytes: int, ck: int):
    """Round-robin replay of the sessions' calls through one PrefixCache."""

    def take(kv: bool = True, checkpoint: bool = True) -> PrefixBlock:
        return PrefixBlock(
            attn=(_zeros(kv_bytes),) if kv else (),
            mtp=None,
            conv=() if checkpoint else None,
            state=() if checkpoint else None,
            h_last=_zeros(ck) if checkpoint else None,
        )

    pc = PrefixCache(block, budget, policy)
    queue = list(range(len(calls)))
    live: list[list] = []  # [session, next call]
    n_calls = tokens = resumed = calls_resumed = 0
    while queue or live:
        while len(live) < concurrency and queue:
            live.append([queue.pop(0), 0])
        for item in list(live):
            s, i = item
            ids = calls[s][i]
            done = pc.store_prompt(ids, take)
            n_calls += 1
            tokens += len(ids)
            resumed += done
            calls_resumed += done > 0
            item[1] += 1
            if item[1] == len(calls[s]):
                live.remove(item)
    return dict(
        policy=policy,
        budget_gb=budget / GiB,
        concurrency=concurrency,
        calls=n_calls,
        prompt_tokens=tokens,
        resumed_tokens=resumed,
        resumed_fraction=resumed / max(tokens, 1),
        calls_resumed=calls_resumed,
        entries=len(pc),
        checkpoints=pc.checkpointed,
        checkpoints_dropped=pc.checkpoints_dropped,
        evicted=pc.evicted,
        rejected=pc.rejected,
        held_gb=pc.bytes / GiB,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3.5-27b", help="model dims of the entries' sizes")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block", type=int, default=256, help="--prefix-block of the server")
    ap.add_argument("--budgets-gb", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 20])
    ap.add_argument(
        "--policies", nargs="+", choices=CHECKPOINT_POLICIES, default=["every", "sparse"]
    )
    ap.add_argument("--sessions-file", default=DEFAULT_SESSIONS)
    ap.add_argument("--tool-docs", choices=["json", "compact"], default="compact")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens of an unrecorded answer")
    ap.add_argument("--max-context", type=int, default=4000, help="the server's --max-context")
    ap.add_argument("--max-sessions", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0, help="session order and unrecorded answers")
    ap.add_argument("--out", required=True, help="folder for prefix_cache.json")
    a = ap.parse_args(argv)

    cfg = preset(a.preset, dtype=a.dtype)
    kv = block_bytes(cfg, a.block, a.dtype, mtp=cfg.mtp_num_layers > 0, checkpoint=False)
    ck = checkpoint_bytes(cfg, a.dtype)
    print(
        f"{a.preset}: {a.block}-token block: {kv / 2**20:.1f} MiB of KV (target + MTP), "
        f"checkpoint {ck / 2**20:.1f} MiB"
    )
    t0 = time.perf_counter()
    tokenizer = Tokenizer(DEFAULT_MODEL_DIR / "tokenizer.json")
    template = ChatTemplate.from_folder(DEFAULT_MODEL_DIR, tokenizer)
    sessions = load_sessions(a.sessions_file, tool_docs=a.tool_docs)
    order = np.random.default_rng(a.seed).permutation(len(sessions))
    sessions = [sessions[i] for i in order[: a.max_sessions]]
    calls = session_calls(sessions, tokenizer, template, a.max_tokens, a.max_context, a.seed)
    n = sum(map(len, calls))
    print(
        f"{len(calls)} sessions, {n} calls, {sum(len(c) for s in calls for c in s)} prompt "
        f"tokens ({time.perf_counter() - t0:.1f} s to render)"
    )
    rows = [
        replay(calls, pol, int(b * GiB), c, a.block, kv, ck)
        for c in a.concurrency
        for b in a.budgets_gb
        for pol in a.policies
    ]
    table = print_table(rows, COLS)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "prefix_cache.json")
    write_json(
        path,
        dict(
            command="python " + " ".join([os.path.relpath(__file__, os.getcwd()), *sys.argv[1:]]),
            env=environment(),
            preset=a.preset,
            dtype=a.dtype,
            block_tokens=a.block,
            kv_bytes_per_block=kv,
            checkpoint_bytes=ck,
            sessions=len(calls),
            max_context=a.max_context,
            max_tokens=a.max_tokens,
            calls=n,
            rows=rows,
            table=table,
        ),
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
