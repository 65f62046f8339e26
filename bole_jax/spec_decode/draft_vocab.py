"""Reduced draft vocabulary: the MTP drafter scores only the V_d most frequent tokens.

Each draft level multiplies its frontier rows by the lm_head [H, V]; at Qwen3.5 sizes (V = 248k,
H = 4096) that is 2 GB read per level, 8 levels per step: the drafter, not the verify, then
dominates a speculative step. Token frequencies are very skewed, so the drafter keeps a column
subset `draft_head = lm_head[:, ids]` of the V_d most frequent tokens (FR-Spec's idea) and maps
its top-k back through `ids`.

Lossless by construction: acceptance never reads the draft distribution (the target-only rule of
`acceptance.py` treats each drafted child as a one-hot proposal), so a smaller candidate set can
only lower the acceptance rate, never change what is emitted. A drafted child outside the
subset is simply never proposed.

Where the ids come from: `draft_vocab.json` in the model folder (token ids, most frequent first,
written by `bole-jax draft-vocab` from a text corpus), else the first V_d ids: byte-level BPE
vocabularies number their merges in the order they were learned, which is roughly frequency
order. EOS ids are always kept.
"""

from __future__ import annotations

import collections
import json
import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bole_jax.model import logits as lm_logits
from bole_jax.model import parallel
from bole_jax.model.config import ModelConfig
from bole_jax.pallas.top_k import top_k_log_softmax

log = logging.getLogger("bole_jax")

DRAFT_VOCAB_FILE = "draft_vocab.json"


def has_draft_vocab(params) -> bool:
    return "draft_head" in params.get("mtp", {})


def draft_top_k(params, cfg: ModelConfig, h: jax.Array, k: int):
    """Top-k of the draft distribution at h [..., H]: (log q [..., k] fp32, token ids [..., k]).

    With a draft vocabulary the softmax runs over its V_d tokens (the scores rank candidates
    only); without one, over the whole lm_head. The top-k is taken on the fp32 logits and the
    logsumexp subtracted from the k winners only: the same order and fp32 scores as a top-k of
    log_softmax, without writing and re-reading a [..., V] fp32 log-prob array (log_softmax's
    output) per draft level."""
    mtp = params["mtp"]
    if "draft_head" in mtp:
        z = jnp.einsum("...h,hv->...v", h, mtp["draft_head"], preferred_element_type=jnp.float32)
        lp, idx = _top_k_log_softmax(z, k, cfg)
        return lp, mtp["draft_ids"][idx]
    return _top_k_log_softmax(lm_logits(params, cfg, h).astype(jnp.float32), k, cfg)


def _top_k_log_softmax(z: jax.Array, k: int, cfg: ModelConfig):
    """`pallas.top_k.top_k_log_softmax` with the model's `KernelOptions.draft_top_k_backend`
    (the reference under tensor parallelism, whose logits XLA partitions over the vocabulary)."""
    backend = "reference" if cfg.tp > 1 else cfg.kernels.draft_top_k_backend
    return top_k_log_softmax(z, k, backend=backend)


def select_ids(
    cfg: ModelConfig, size: int, model_dir: str | os.PathLike | None = None
) -> tuple[np.ndarray, str]:
    """The `size` draft token ids (sorted) and where they came from (for logs and results)."""
    v = cfg.vocab_size
    if type(size) is not int or size < 1:
        raise ValueError(f"draft vocabulary size must be a positive int, got {size!r}")
    if size >= v:
        raise ValueError(
            f"draft vocabulary size {size} must be smaller than the vocabulary ({v}); "
            "leave it unset to draft over the whole vocabulary"
        )
    order, source = None, f"first {size} token ids (BPE merge order)"
    path = Path(model_dir) / DRAFT_VOCAB_FILE if model_dir is not None else None
    if path is not None and path.is_file():
        try:
            order = np.asarray(json.loads(path.read_text())["token_ids"], np.int64)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}: expected a JSON object with a 'token_ids' list ({e})"
            ) from None
        if order.ndim != 1 or (order.size and (order.min() < 0 or order.max() >= v)):
            raise ValueError(f"{path}: token_ids must be ids in [0, {v})")
        source = f"{size} most frequent token ids of {path}"
    if order is None:
        order = np.arange(v)
    eos = [e for e in cfg.eos_token_ids if 0 <= e < v]
    _, first = np.unique(order, return_index=True)
    order = order[np.sort(first)]  # de-duplicated, frequency order kept
    if order.size < size:  # a short frequency list: top up in id order
        order = np.concatenate([order, np.setdiff1d(np.arange(v), order)])
    keep = list(eos) + [t for t in order[:size].tolist() if t not in eos]
    return np.sort(np.asarray(keep[:size], np.int32)), source


def with_draft_vocab(params, cfg: ModelConfig, ids: Sequence[int] | np.ndarray):
    """params with `mtp.draft_ids` [V_d] int32 and `mtp.draft_head` [H, V_d] (the lm_head columns,
    or the tied embedding rows) added. The head is a copy (V_d / V of the lm_head's bytes),
    replicated under tensor parallelism."""
    if "mtp" not in params:
        raise ValueError(
            "a draft vocabulary needs the MTP drafter (the model has no mtp.* weights)"
        )
    ids = np.asarray(ids, np.int32)
    if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"draft ids must be a non-empty list of ids in [0, {cfg.vocab_size})")
    idx = jnp.asarray(ids)
    head = (
        jnp.take(params["embed"], idx, axis=0).T
        if cfg.tie_word_embeddings
        else jnp.take(params["lm_head"], idx, axis=1)
    )
    if cfg.tp > 1:
        rep = jax.sharding.NamedSharding(parallel.make_mesh(cfg.tp), jax.sharding.PartitionSpec())
        head, idx = jax.device_put(head, rep), jax.device_put(idx, rep)
    mtp = dict(params["mtp"], draft_ids=idx, draft_head=head)
    return dict(params, mtp=mtp)


def restrict(params, cfg: ModelConfig, size: int, model_dir: str | os.PathLike | None = None):
    """`select_ids` then `with_draft_vocab`: (params with the draft head, where the ids came
    from). Logs the choice once."""
    ids, source = select_ids(cfg, size, model_dir)
    log.info("bole_jax: the drafter scores %d of %d tokens (%s)", len(ids), cfg.vocab_size, source)
    return with_draft_vocab(params, cfg, ids), source


def without_draft_vocab(params):
    if not has_draft_vocab(params):
        return params
    mtp = {k: v for k, v in params["mtp"].items() if k not in ("draft_ids", "draft_head")}
    return dict(params, mtp=mtp)


def token_frequencies(docs: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """Counts [V] of token ids over tokenised documents."""
    counts = collections.Counter()
    for ids in docs:
        counts.update(ids)
    out = np.zeros(vocab_size, np.int64)
    for t, c in counts.items():
        if 0 <= t < vocab_size:
            out[t] = c
    return out


def frequency_order(counts: np.ndarray) -> np.ndarray:
    """Every token id, most frequent first (ties by id)."""
    return np.lexsort((np.arange(counts.size), -counts))


def write_draft_vocab(model_dir: str | os.PathLike, counts: np.ndarray, source: str) -> Path:
    """Write draft_vocab.json (`frequency_order` of the counts) into the model folder."""
    order = frequency_order(counts)
    path = Path(model_dir) / DRAFT_VOCAB_FILE
    path.write_text(
        json.dumps(
            {"source": source, "tokens_counted": int(counts.sum()), "token_ids": order.tolist()}
        )
    )
    return path
