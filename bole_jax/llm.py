"""`LLM`: the user-facing offline generation API.

    llm = bole_jax.LLM("path/to/hf_folder")          # or LLM() for the embedded demo model
    outs = llm.generate(["def fib(n):"], max_new_tokens=64)
    print(outs[0].text, outs[0].stats)

Shapes are bucketed (batch, output buffer and KV capacity to powers of two, prompt chunks to a
fixed set) so that repeated calls with other prompts, lengths or batch sizes of a bucket reuse
compiled programs; the compiled programs are also kept on disk across processes (JAX's persistent
compilation cache, `bole_jax.compile_cache`: on by default, folder $BOLE_JAX_CACHE/xla or
~/.cache/bole_jax/xla, `LLM(compile_cache=...)` or $BOLE_JAX_COMPILE_CACHE to move it, 0 for off).
Prompts longer than one chunk are prefilled in chunks.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bole_jax import compile_cache as compile_cache_mod
from bole_jax.measure import calibrate as calibrate_mod
from bole_jax.model import ModelConfig, init_cache, parallel
from bole_jax.model.cache import with_pending
from bole_jax.model.mtp import init_mtp_cache, require_mtp
from bole_jax.model.weights import load_hf_checkpoint
from bole_jax.pallas.options import KernelOptions
from bole_jax.pallas.tree_utils import next_pow2
from bole_jax.sampling import SamplingParams, validate_sampling
from bole_jax.spec_decode import draft_vocab as draft_vocab_mod
from bole_jax.spec_decode import loop
from bole_jax.spec_decode.budget import simulated_accept_prob, spec_options_for
from bole_jax.spec_decode.drafter import DraftState, draft_cache_capacity, prefill_rows
from bole_jax.spec_decode.step import SPEC_MODES, SpecConfig, spec_step

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
PREFILL_CHUNK = 256  # prompt tokens per prefill call (bigger prompts take several calls)
# Cap on one prefill call's fp32 attention scores of one layer (rows x heads x width x capacity x
# 4 bytes): a wide batch at a long capacity prefills in narrower pieces instead of running out
# of memory (128 rows x 16 heads x 256 tokens x 16384 slots would be 32 GiB).
PREFILL_SCORES_BYTES = 1 << 30
SEGMENT_STEPS = 16  # decode steps per jitted segment (host checks stops / progress between)
# `generate` decodes at most the rows whose estimated state (serving.memory.slot_bytes) fits this
# share of the device's free memory; the rest is left to the compiled programs' temporaries and
# activations, which the estimate does not count.
GENERATE_MEMORY_SHARE = 0.9
MIN_OUT_BUCKET = 16  # smallest output buffer (max_new_tokens is rounded up to a power of two)


def prefill_width(cfg: ModelConfig, rows: int, capacity: int, longest: int) -> int:
    """Prompt tokens per batched prefill call: the longest prompt rounded up to a power of two
    (16 at least), at most PREFILL_CHUNK, and narrower where one attention layer's fp32 scores
    (rows x query heads x width x capacity) would pass PREFILL_SCORES_BYTES (a power of two, 1 at
    least)."""
    width = min(PREFILL_CHUNK, next_pow2(longest, minimum=16))
    if cfg.attention_layers:
        heads = cfg.num_heads // parallel.shards(cfg, cfg.num_heads)
        fit = PREFILL_SCORES_BYTES // (rows * heads * capacity * 4)
        width = min(width, 1 << max(fit, 1).bit_length() - 1)
    return width


@jax.jit
def _emit_first(light: loop.DecodeState, tok0: jax.Array) -> loop.DecodeState:
    """Emit the first token tok0 [B] into a state without caches."""
    return loop.emit(light, tok0[:, None], jnp.ones_like(tok0))


def out_bucket(max_new: int) -> int:
    """Length of the output buffer for max_new_tokens: the power of two >= it (at least
    MIN_OUT_BUCKET), so that other lengths of a bucket run the same compiled programs (each
    request's `max_out` still stops it at its own max_new_tokens)."""
    return next_pow2(max_new, minimum=MIN_OUT_BUCKET)


@dataclasses.dataclass
class GenerationOutput:
    """One request's result. `stats` holds per-request numbers (see LLM.generate)."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: dict[str, Any]


class Tokenizer:
    """Thin wrapper over a `tokenizers` tokenizer.json (no transformers needed at run time)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_to_id(self, tok: str) -> int | None:
        return self._tok.token_to_id(tok)


def _tensor_parallel_model(cfg: ModelConfig, tp: int | None, params, seed: int, dtype):
    """(cfg with tp, params in its layout on the mesh) for LLM(ModelConfig, tp=...) with tp > 1."""
    if tp is not None and tp != cfg.tp and cfg.tp > 1:
        raise ValueError(
            f"this ModelConfig has tp={cfg.tp} (its params are laid out for {cfg.tp} "
            f"devices): pass tp={cfg.tp}, or a config with tp=1 and canonical params"
        )
    laid_out = cfg.tp > 1  # params given with a tp > 1 config are already in that layout
    cfg = dataclasses.replace(cfg, tp=tp or cfg.tp)
    if params is None:
        return cfg, parallel.init_params(cfg, jax.random.key(seed), dtype or cfg.dtype)
    return cfg, (
        parallel.place_params(params, cfg) if laid_out else parallel.shard_params(params, cfg)
    )


class LLM:
    """Offline generation over a hybrid (GDN + attention) model.

    Args:
      model: a local Hugging Face folder (config.json, *.safetensors, tokenizer.json), a
        `ModelConfig` (random weights, prompts must be token ids), or None for the demo model
        embedded in the package.
      dtype: "bfloat16" / "float32" (default: the checkpoint's dtype, float32 on CPU).
      max_batch_size: requests decoded together; more prompts run in several batches.
      seed: PRNG seed for random weights (ModelConfig only).
      params: weights for a `ModelConfig` model, in that config's layout: canonical (params.py)
        when its tp is 1, else the tensor-parallel layout (e.g. another LLM's .params).
      tp: tensor-parallel devices (default: the ModelConfig's tp, else 1). > 1 splits the weights,
        caches and kernels over the first tp devices (bole_jax/model/parallel.py); self.cfg.tp says it,
        and self.params are then in the tensor-parallel layout.
      draft_vocab: the MTP drafter scores only this many tokens (the most frequent: the model
        folder's draft_vocab.json, else the first ids; spec_decode/draft_vocab.py). Lossless: it
        changes which drafts are proposed, never what is emitted. None: the whole vocabulary.
      compile_cache: folder of JAX's persistent compilation cache (compiled programs reused by the
        next process). None (default): $BOLE_JAX_COMPILE_CACHE, else jax's own setting, else
        $BOLE_JAX_CACHE/xla or $XDG_CACHE_HOME/bole_jax/xla; False or "none": off. See
        bole_jax/compile_cache.py.
      kernel_options: which kernels run (`KernelOptions`; set on self.cfg.kernels and every
        SpecConfig). None: `KernelOptions.from_env()`, the BOLE_* environment variables as
        defaults (bole_jax/pallas/options.py lists them).
    Raises `parallel.WeightsDoNotFit` (a ValueError) before allocating weights larger than the
    memory the device has available.
    """

    def __init__(
        self,
        model: str | os.PathLike | ModelConfig | None = None,
        *,
        dtype: str | None = None,
        max_batch_size: int = 64,
        seed: int = 0,
        params: Any = None,
        spec_options: dict | None = None,
        tp: int | None = None,
        draft_vocab: int | None = None,
        compile_cache: str | os.PathLike | bool | None = None,
        kernel_options: KernelOptions | None = None,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if tp is not None:
            tp = parallel.check_tp(tp)
        self.max_batch_size = max_batch_size
        self.compile_cache = compile_cache_mod.enable(compile_cache)  # the folder, None when off
        # Tree shape of the speculative modes: topk, depth, num_nodes (SpecConfig.for_mode).
        self.spec_options = dict(spec_options or {})
        self._resolved_spec_options: dict = {}  # (batch bucket, mode, kv) -> options + shape
        self.tokenizer: Tokenizer | None = None
        if dtype is None and jax.default_backend() == "cpu":
            dtype = "float32"  # bf16 matmuls are emulated (slow) on CPU
        if isinstance(model, ModelConfig) and (tp is None or tp == model.tp) and model.tp == 1:
            self.cfg = model
            self.params = (
                params
                if params is not None
                else parallel.init_params(model, jax.random.key(seed), dtype or model.dtype)
            )
            self.path = None
        elif isinstance(model, ModelConfig):
            self.cfg, self.params = _tensor_parallel_model(model, tp, params, seed, dtype)
            self.path = None
        else:
            path = Path(model) if model is not None else DEFAULT_MODEL_DIR
            if not path.is_dir():
                raise FileNotFoundError(
                    f"model folder not found: {path} (pass a local Hugging Face "
                    "folder with config.json and *.safetensors)"
                )
            if tp is None or tp == 1:
                self.cfg, self.params = load_hf_checkpoint(path, dtype=dtype)
            else:  # each tensor goes to the mesh as it is read: no device holds the whole model
                layout = dataclasses.replace(ModelConfig.from_pretrained(path), tp=tp)
                cfg, self.params = load_hf_checkpoint(
                    path, dtype=dtype, place=functools.partial(parallel.layout_leaf, layout)
                )
                self.cfg = dataclasses.replace(cfg, tp=tp)
            self.path = path
            tok = path / "tokenizer.json"
            if tok.exists():
                self.tokenizer = Tokenizer(tok)
        self.cfg = dataclasses.replace(
            self.cfg,
            kernels=(KernelOptions.from_env() if kernel_options is None else kernel_options),
        )
        parallel.log_layout(self.cfg)
        self.eos_ids = tuple(self.cfg.eos_token_ids) or (-1,)
        self.draft_vocab_source = None
        if draft_vocab is not None:
            require_mtp(self.cfg, self.params)
            self.params, self.draft_vocab_source = draft_vocab_mod.restrict(
                self.params, self.cfg, draft_vocab, self.path
            )

    # ------------------------------------------------------------------ helpers
    def _encode(self, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
        ids = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(
                        "this model has no tokenizer.json: pass prompts as lists of token ids"
                    )
                toks = self.tokenizer.encode(p)
            else:
                toks = [int(t) for t in p]
                bad = [t for t in toks if not 0 <= t < self.cfg.vocab_size]
                if bad:
                    raise ValueError(
                        f"prompt {i}: token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}"
                    )
            if not toks:
                raise ValueError(f"prompt {i} is empty (after tokenisation)")
            ids.append(toks)
        return ids

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    # ------------------------------------------------------------------ API
    def generate(
        self,
        prompts: str | Sequence[str | Sequence[int]],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
        spec: str | None = None,
        max_context: int | None = None,
        progress: bool = False,
        oracle: Sequence[Sequence[int]] | None = None,
    ) -> list[GenerationOutput]:
        """Generate continuations for a list of prompts (strings or token-id lists).

        Sampling is greedy for temperature 0; otherwise temperature, then top-k (0 = off), then
        top-p (1 = off). Generation stops at an EOS token, a stop string (excluded from the text), or
        max_new_tokens. `stats` per request: prompt_tokens, generated_tokens, steps (decode steps the
        request was active, prefill excluded), tokens_per_step, time_s (wall time of its batch),
        tokens_per_s (its generated tokens / time_s), mode, drafter, tree (the speculation's shape:
        nodes per request, depth, topk, the batch-wide budget; None for ar).

        spec: "ar", "bole", "pernode" or "chain"; None (default): per batch bucket, the mode the
          calibration table expects fastest (docs/budget.md), ar without a table. The mode and the
          tree shape are the table's at the KV capacity the longest request needs (prompt +
          max_new_tokens), where the table timed long contexts (`bole-jax calibrate --context`).
        Prompts are decoded max_batch_size at a time, or fewer where the device's free memory
        does not hold that many requests' decode state (`_rows_that_fit`, logged); a request
        that does not fit alone raises a ValueError.
        oracle: benchmarks only, with spec_options={"synthetic_accept": p}: the target's own
          continuation of every prompt, which the synthetic-acceptance drafter places in the tree
          (each depth correct with probability p). Outputs then say drafter="synthetic acceptance".
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            return []
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        validate_sampling(temperature, top_p, top_k)
        ids = self._encode(prompts)
        # The mode for the batch bucket and the context it decodes at (a table timed at long
        # contexts can choose ar there): the KV capacity the longest request needs.
        longest = max(map(len, ids))
        kv = next_pow2(longest + max_new_tokens + 1, minimum=64)
        mode = calibrate_mod.decode_mode(self, spec, min(len(prompts), self.max_batch_size), kv)
        if mode != "ar":
            # (the bucket of the first batch: the tree width, and the no-table notice, follow it)
            spec_cfg = self._spec_config(
                mode, next_pow2(min(len(prompts), self.max_batch_size), minimum=1), kv=kv
            )
            require_mtp(self.cfg, self.params)
            if (spec_cfg.synthetic_accept is None) != (oracle is None):
                raise ValueError(
                    "the synthetic-acceptance drafter needs both spec_options="
                    "{'synthetic_accept': p} and generate(..., oracle=continuations)"
                )
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        max_context = max_context or self.cfg.max_position_embeddings
        for i, t in enumerate(ids):
            if len(t) + max_new_tokens > max_context:
                raise ValueError(
                    f"prompt {i} has {len(t)} tokens; with max_new_tokens={max_new_tokens} "
                    f"it exceeds the maximum context of {max_context} tokens"
                )
        # As many prompts per batch as max_batch_size allows and the device's free memory holds
        # (a batch too large for it would end in an out-of-memory error partway through).
        per_batch = self._rows_that_fit(mode, len(ids), longest, max_new_tokens, kv)
        want = min(len(ids), self.max_batch_size)
        if per_batch < want:
            mode2 = calibrate_mod.decode_mode(self, spec, per_batch, kv)
            if mode2 != mode:  # the choice at the batch that fits (e.g. a tree at fewer rows)
                mode = mode2
                per_batch = self._rows_that_fit(mode, per_batch, longest, max_new_tokens, kv)

        outputs: list[GenerationOutput] = []
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids) * max_new_tokens, unit="tok", desc=f"generate[{mode}]")
        for start in range(0, len(ids), per_batch):
            chunk = ids[start : start + per_batch]
            orc = None if oracle is None else oracle[start : start + per_batch]
            # Every batch starts from key(seed) and each prompt samples from its own stream (its index
            # here): the same seed gives the same outputs whatever max_batch_size (sampling.row_keys).
            outputs += self._generate_batch(
                chunk,
                max_new_tokens,
                temperature,
                top_p,
                top_k,
                seed,
                stops,
                mode,
                bar,
                orc,
                first=start,
                kv=kv,
            )
        if bar is not None:
            bar.close()
        return outputs

    def _rows_that_fit(self, mode: str, n: int, longest: int, max_new: int, kv: int) -> int:
        """Prompts per batch: min(n, max_batch_size), halved (a batch's state has next_pow2 rows)
        until the estimated decode state of its rows (`serving.memory.slot_bytes`: KV cache,
        recurrent states, drafter cache, outputs, the step's verify transient) fits
        GENERATE_MEMORY_SHARE of the device's free memory; logged when that is fewer. Raises a
        ValueError where one request does not fit. Unchanged where the backend reports no free
        memory."""
        from bole_jax.serving.memory import kv_capacity, slot_bytes

        c = min(n, self.max_batch_size)
        free = parallel.available_bytes()
        if free is None:
            return c
        budget = free * GENERATE_MEMORY_SHARE
        out_len = out_bucket(max_new)
        dtype = self.params["embed"].dtype
        while True:
            rows = next_pow2(c, minimum=1)
            spec = None if mode == "ar" else self._spec_config(mode, rows, quiet=True, kv=kv)
            slack = spec.slack if spec else 0
            capacity = kv_capacity(longest + out_len, slack)  # start_batch's, for this batch
            per_row = sum(slot_bytes(self.cfg, capacity, out_len, spec, dtype).values())
            if rows * per_row <= budget:
                break
            if rows == 1:
                raise ValueError(
                    f"one request of {longest} prompt tokens and max_new_tokens={max_new} "
                    f"({mode}, KV capacity {capacity}) needs about {per_row / 2**20:.0f} MiB "
                    f"of decode state, more than the {free / 2**20:.0f} MiB the device has "
                    "free: shorten the prompt or max_new_tokens"
                )
            c = rows // 2
        if c < min(n, self.max_batch_size):
            import logging

            logging.getLogger("bole_jax").warning(
                "bole_jax: %d prompts at KV capacity %d need about %.0f MiB of decode state "
                "each (%s); the device's %.1f GiB free hold batches of %d (max_batch_size %d)",
                n,
                capacity,
                per_row / 2**20,
                mode,
                free / 2**30,
                c,
                self.max_batch_size,
            )
        return c

    def start_batch(
        self,
        ids: Sequence[Sequence[int]],
        max_new: int,
        *,
        mode: str = "ar",
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed: int = 0,
        oracle=None,
        extra_capacity: int = 0,
        spec_batch: int | None = None,
        spec_kv: int | None = None,
        out_len: int | None = None,
        stream=-1,
        rows: int | None = None,
    ) -> loop.DecodeState:
        """Prefill a batch of token-id prompts and return the DecodeState the jitted loop advances
        (the first generated token already emitted). Public for benchmarks and notebooks:

            state = llm.start_batch(ids, 64, mode="bole")
            state = llm.segment_fn("bole")(llm.params, state, jnp.int32(16))   # 16 steps

        spec_batch, spec_kv: the batch bucket and KV capacity whose (calibrated) tree shape to lay
        the state out for; pass the same values to `segment_fn` (default for both: max_batch_size,
        and the calibration's own context: `budget.choose`).
        out_len: length of the output buffer `out` [B, out_len] (>= max_new; default max_new). The KV
        capacity is sized for it, so every max_new up to out_len gives the same shapes.
        stream: each request's random stream ([n] ints, or one for all; -1: its row), see sampling.py.
        rows: the state's batch rows, padding rows (done) past the prompts (default: the next power
        of two, so batches of nearby sizes share one compiled step; the serving engine and the
        fixed-memory benchmark lay out exactly the slots the memory plan admits).
        """
        cfg = self.cfg
        n = len(ids)
        b = next_pow2(n, minimum=1) if rows is None else rows
        if b < n:
            raise ValueError(f"rows={rows} < the {n} prompts")
        lens = np.array([len(t) for t in ids] + [1] * (b - n), np.int32)
        spec = None if mode == "ar" else self._spec_config(mode, spec_batch, kv=spec_kv)
        slack = spec.slack if spec else 0
        out_len = max(out_len or max_new, max_new)
        capacity = next_pow2(int(lens.max()) + out_len + slack + extra_capacity + 1, minimum=64)
        cache, draft_kv = self.prefill_caches(
            b, capacity, mode=mode, spec_batch=spec_batch, spec_kv=spec_kv
        )
        # Chunked prefill: every request advances by up to PREFILL_CHUNK tokens per call.
        toks = np.zeros((b, int(lens.max())), np.int32)
        for i, t in enumerate(ids):
            toks[i, : len(t)] = t
        h_last = None
        chunk = prefill_width(cfg, b, capacity, int(lens.max()))
        for s in range(0, int(lens.max()), chunk):
            piece = np.zeros((b, chunk), np.int32)
            width = min(chunk, toks.shape[1] - s)
            piece[:, :width] = toks[:, s : s + width]
            num_new = np.clip(lens - s, 0, chunk).astype(np.int32)
            # (numpy arguments: jnp.asarray would compile a program per shape)
            h_last, cache, draft_kv = loop.prefill_chunk(
                self.params, cache, piece, num_new, h_last, draft_kv, cfg=cfg
            )
        return self.state_after_prefill(
            cache,
            draft_kv,
            h_last,
            n,
            max_new,
            mode=mode,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            oracle=oracle,
            spec_batch=spec_batch,
            spec_kv=spec_kv,
            out_len=out_len,
            stream=stream,
        )

    def prefill_caches(
        self,
        batch: int,
        capacity: int,
        *,
        mode: str = "ar",
        spec_batch: int | None = None,
        spec_kv: int | None = None,
    ):
        """Empty caches for a prefill: (target `Cache` of KV capacity `capacity`, the MTP drafter's KV
        cache, or None for ar). The MTP cache has room for a step's draft rows past `capacity`."""
        spec = None if mode == "ar" else self._spec_config(mode, spec_batch, kv=spec_kv)
        dtype = self.params["embed"].dtype
        # parallel.zeros: under tensor parallelism the caches are made in place on the mesh.
        cache = parallel.zeros(lambda: init_cache(self.cfg, batch, capacity, dtype), self.cfg)
        draft_kv = None
        if spec:
            draft_kv = parallel.zeros(
                lambda: init_mtp_cache(
                    self.cfg, batch, draft_cache_capacity(capacity, spec.shape), dtype
                ),
                self.cfg,
            )
        return cache, draft_kv

    def state_after_prefill(
        self,
        cache,
        draft_kv,
        h_last,
        n: int,
        max_new: int,
        *,
        mode: str = "ar",
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed: int = 0,
        oracle=None,
        spec_batch: int | None = None,
        spec_kv: int | None = None,
        out_len: int | None = None,
        stream=-1,
        static_greedy: bool = True,
    ) -> loop.DecodeState:
        """The DecodeState once the prompts are in `cache` (and `draft_kv`): samples the first token
        from h_last [B, H] (each prompt's last hidden state) with `seed` and emits it. Rows >= n are
        padding (done). `out` is [B, out_len] (default max_new), `max_out` max_new. `stream`: the
        requests' random streams ([n] ints or one int; -1 = the row, `sampling.SamplingParams`).
        `static_greedy`: a batch whose temperatures are all 0 gets the greedy-only program
        (`SamplingParams.greedy`); off, the program that serves any mix (the serving engine's
        running batch). Used by `start_batch` and by the serving engine's chunked prefill. The
        GDN caches get the mode's layout (`SpecConfig.pending_length`: lazy bole carries a pending
        commit, empty here)."""
        cfg = self.cfg
        b = h_last.shape[0]
        out_len = max(out_len or max_new, max_new)
        spec = None if mode == "ar" else self._spec_config(mode, spec_batch, kv=spec_kv)
        streams = np.full((b,), -1, np.int32)
        streams[:n] = stream
        sp = SamplingParams.make(b, temperature, top_p, top_k, streams, static_greedy=static_greedy)
        key = jax.random.key(seed)
        key, sub = jax.random.split(key)
        tok0 = loop.first_token(self.params, h_last, sp, sub, cfg=cfg)
        # The GDN caches in this mode's layout: an empty pending commit per layer for lazy bole
        # (the loop carry keeps one structure), none otherwise.
        cache = with_pending(
            cache, cfg, spec.pending_length if spec else None, spec.pending_nodes if spec else None
        )
        extra = None
        if spec:
            toks, hid, count = prefill_rows(tok0, h_last, p=spec.shape.path_nodes)
            extra = DraftState(
                kv=draft_kv,
                pend_tokens=toks,
                pend_hidden=hid,
                pend_count=count,
                oracle=None
                if oracle is None
                else jax.device_put(self._pad_oracle(oracle, b, out_len)),
            )
        # Host-built fields and one jitted emit (eager jnp ops would compile a program each); the
        # caches stay out of the jit, which would copy them.
        light = loop.DecodeState(
            cache=None,
            out=np.full((b, out_len), -1, np.int32),
            num_out=np.zeros((b,), np.int32),
            next_token=np.zeros((b,), np.int32),
            done=np.arange(b) >= n,
            max_out=np.full((b,), max_new, np.int32),
            steps=np.zeros((b,), np.int32),
            sampling=sp,
            key=key,
            eos=np.asarray(self.eos_ids, np.int32),
            extra=None,
        )
        light = _emit_first(light, tok0)
        return parallel.place(dataclasses.replace(light, cache=cache, extra=extra), cfg)

    def _generate_batch(
        self,
        ids,
        max_new,
        temperature,
        top_p,
        top_k,
        seed,
        stops,
        mode,
        bar,
        oracle=None,
        first: int = 0,
        kv: int | None = None,
    ):
        n = len(ids)
        # The tree shape follows the batch actually decoded and the context it decodes at.
        bucket = next_pow2(n, minimum=1)
        spec = None if mode == "ar" else self._spec_config(mode, bucket, kv=kv)
        t0 = time.perf_counter()
        state = self.start_batch(
            ids,
            max_new,
            mode=mode,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            oracle=oracle,
            spec_batch=bucket,
            spec_kv=kv,
            out_len=out_bucket(max_new),
            stream=np.arange(first, first + n),
        )
        jax.block_until_ready(state.out)
        ttft = time.perf_counter() - t0
        segment = self.segment_fn(mode, bucket, kv)
        stopped_at: dict[int, int] = {}
        prev = 0
        while True:
            done = np.asarray(state.done)
            num_out = np.asarray(state.num_out)
            if bar is not None:
                total = int(num_out[:n].sum())
                bar.update(total - prev)
                prev = total
            if stops and self.tokenizer is not None:
                out = np.asarray(state.out)
                newly = []
                for i in range(n):
                    if i in stopped_at:
                        continue
                    cut = self._find_stop(out[i, : num_out[i]], stops)
                    if cut is not None:
                        stopped_at[i] = cut
                        newly.append(i)
                if newly:
                    state = dataclasses.replace(
                        state, done=state.done.at[jnp.asarray(newly)].set(True)
                    )
                    done = np.asarray(state.done)
            if done.all():
                break
            state = segment(self.params, state, jnp.int32(SEGMENT_STEPS))
        elapsed = time.perf_counter() - t0
        if bar is not None:
            bar.update(max_new * n - prev)
        out = np.asarray(state.out)
        num_out = np.asarray(state.num_out)
        steps = np.asarray(state.steps)
        results = []
        drafter = (
            "none"
            if mode == "ar"
            else (
                f"synthetic acceptance (p={spec.synthetic_accept})"
                if spec.synthetic_accept is not None
                else f"mtp, simulated acceptance (p={spec.simulate_accept:.4f})"
                if spec.simulate_accept is not None
                else "mtp"
            )
        )
        if mode != "ar" and draft_vocab_mod.has_draft_vocab(self.params):
            drafter += f", {self.params['mtp']['draft_ids'].shape[0]}-token draft vocabulary"
        # The speculation decoded with (None for ar): nodes verified per request, draft depth,
        # children per node, the batch-wide node budget.
        tree = (
            None
            if mode == "ar"
            else dict(
                nodes=spec.shape.num_nodes,
                depth=spec.shape.depth,
                topk=spec.shape.topk,
                budget=spec.budget,
            )
        )
        eos_set = set(self.eos_ids)
        for i in range(n):
            toks_i = [int(t) for t in out[i, : num_out[i]]]
            reason = "length"
            if i in stopped_at:
                toks_i, reason = toks_i[: stopped_at[i]], "stop"
            elif toks_i and toks_i[-1] in eos_set:
                reason = "stop"
            text = self._decode(toks_i)
            if reason == "stop" and stops:
                for s_ in stops:
                    j = text.find(s_)
                    if j >= 0:
                        text = text[:j]
            gen = len(toks_i)
            results.append(
                GenerationOutput(
                    text=text,
                    token_ids=toks_i,
                    prompt_token_ids=list(ids[i]),
                    finish_reason=reason,
                    stats=dict(
                        mode=mode,
                        tree=tree,
                        drafter=drafter,
                        prompt_tokens=len(ids[i]),
                        generated_tokens=gen,
                        steps=int(steps[i]),
                        tokens_per_step=float((num_out[i] - 1) / max(int(steps[i]), 1)),
                        ttft_s=ttft,
                        time_s=elapsed,
                        tokens_per_s=gen / elapsed,
                    ),
                )
            )
        return results

    @staticmethod
    def _pad_oracle(oracle, b, max_new) -> np.ndarray:
        arr = np.zeros((b, max_new + 1), np.int32)
        for i, o in enumerate(oracle):
            o = list(o)[: max_new + 1]
            arr[i, : len(o)] = o
        return arr

    def _find_stop(self, toks: np.ndarray, stops: list[str]) -> int | None:
        """Number of tokens to keep when a stop string appears in the decoded tokens, else None."""
        text = self._decode(toks)
        if not any(s in text for s in stops):
            return None
        for k in range(1, len(toks) + 1):  # shortest prefix containing a stop string
            t = self._decode(toks[:k])
            if any(s in t for s in stops):
                return k
        return len(toks)

    @property
    def default_spec(self) -> str:
        """'bole' when the model has an MTP head (the drafter), else plain autoregressive."""
        return "bole" if self.cfg.mtp_num_layers and "mtp" in self.params else "ar"

    def _spec_config(
        self, mode: str, batch: int | None = None, quiet: bool = False, kv: int | None = None
    ) -> SpecConfig:
        """SpecConfig for `mode` at a batch bucket (default: max_batch_size) and the KV capacity
        `kv` the batch decodes at (None: the calibration's own context). The tree shape comes from
        a matching calibration table (bole-jax calibrate; its entry for the KV bucket, as the mode
        was chosen), else a safe default (logged once; `quiet`: a configuration looked up for
        comparison only, neither logged nor remembered); explicit spec_options win."""
        if mode not in ("ar",) + SPEC_MODES:
            raise ValueError(f"unknown spec mode {mode!r}: expected one of {('ar',) + SPEC_MODES}")
        batch = batch or self.max_batch_size
        known = self._resolved_spec_options
        if (batch, mode, kv) not in known and not quiet:
            known[batch, mode, kv] = spec_options_for(self, mode, batch, kv=kv)
        if (batch, mode, kv) in known:
            opts = dict(known[batch, mode, kv])
        else:
            opts = spec_options_for(self, mode, batch, quiet=True, kv=kv)
        if opts.get("simulate_accept_mean") is not None:  # p at the depth this mode drafts
            if "simulate_accept" in opts:
                raise ValueError("give spec_options simulate_accept or simulate_accept_mean")
            opts["simulate_accept"] = simulated_accept_prob(opts)
        opts.pop("simulate_accept_mean", None)
        return SpecConfig.for_mode(mode, **opts, kernels=self.cfg.kernels)

    def calibrate(self, **kwargs) -> dict:
        """Measure this model's decode configurations and store the table in the user cache
        (`bole_jax.measure.calibrate.calibrate` takes the keyword arguments); later calls decode
        with its choices. Returns the table."""
        table = calibrate_mod.calibrate(self, **kwargs)
        table["path"] = str(calibrate_mod.store(table))
        self._resolved_spec_options.clear()
        LLM._segment_program.cache_clear()
        return table

    def segment_fn(self, mode: str, batch: int | None = None, kv: int | None = None):
        """The jitted segment for `mode` (and the batch bucket and KV capacity, which set the
        calibrated tree shape: `start_batch`'s spec_batch and spec_kv): (params, state, max_steps)
        -> state, with the state donated. Every KV capacity that resolves to the same
        configuration shares one jit (and its compiled programs)."""
        spec = None if mode == "ar" else self._spec_config(mode, batch, kv=kv)
        return self._segment_program(mode, batch, spec)

    @functools.lru_cache(maxsize=None)
    def _segment_program(self, mode: str, batch: int | None, spec: SpecConfig | None):
        if mode == "ar":
            step = functools.partial(loop.ar_step, cfg=self.cfg)
        else:
            step = functools.partial(spec_step, cfg=self.cfg, spec=spec)
        step = parallel.constrained_step(
            step, self.cfg
        )  # tp > 1: the carried state keeps its layout
        return jax.jit(
            functools.partial(loop.run_segment, step_fn=step), donate_argnames=("state",)
        )
