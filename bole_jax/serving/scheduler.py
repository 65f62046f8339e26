"""Continuous batching: one engine thread advances a fixed set of decode slots; requests come and go.

Design
------
- Slots. The engine keeps ONE running `DecodeState` with `num_slots` rows (axis 0 of every batched
  array), the same KV capacity S in every row and an output buffer of `max_context` tokens per row.
  Its shapes never change, so the decode segment compiles once per (mode, slots, capacity).
- Decode groups (`slot_group` G). The slots may be split into groups of G rows, each its own
  `DecodeState` with its own compiled segment (one for G rows, one for a smaller last group): an
  iteration runs only the groups that hold a request, and a new request takes the lowest free slot,
  so the step's work follows the requests actually running instead of the slots planned. Each group
  verifies its own trees (a batch-wide budget applies per group). With one group (the default) the
  whole batch is one step: fewest launches, the work of every slot in every step.
- Segments. Each iteration advances the state by at most `segment_steps` decode steps in one jitted
  call (`LLM.segment_fn(mode)`, state donated) and reads back only the tokens emitted since the
  last read. Requests join and leave between segments, so a segment's length is how late a cancel
  or a new request can act: with `segment_ms` the number of steps adapts to the measured time of
  one step so that a segment lasts about `segment_ms` (one step at least, `segment_steps` at
  most). The step count is an argument of the compiled loop, not a shape: it never recompiles.
- Chunked prefill. A new request is prefilled alone (batch 1, capacity S) by a `PrefillJob`, in
  pieces of `prefix_block` tokens that end on block boundaries (the last one shorter), at most
  `prefill_chunk` prompt tokens per iteration: a long prompt is spread over several iterations and
  every iteration still runs a decode segment, so the running rows keep streaming. One request is
  prefilled at a time, and only while a slot is free: the oldest waiting one of the HTTP request
  holding the fewest slots (`_next_waiting`: FIFO between single requests, turns between
  multi-prompt / `n` requests), and each iteration advances the one started, so nothing starves.
- Prefix cache (`prefix_cache.py`). After every full block the job stores the block's KV rows (and
  the MTP rows in the spec modes), and where a later request can resume (the prompt's last full
  block, a branch point; every block with `prefix_checkpoints="every"`) the recurrent-state
  checkpoint at its end (GDN conv + state, last hidden state); a new request restores its longest
  cached chain up to the deepest checkpoint on it and prefills only the rest. GDN layers cannot
  resume anywhere else: that is why pieces are block-aligned. LRU eviction under a byte budget.
- Insertion. When the last piece is done, `LLM.state_after_prefill` samples the first token with
  the request's own key and the row is written into the lowest free slot by `insert_slot` (jitted,
  state donated):
  `dynamic_update_slice` along axis 0 of every batched leaf (cache layers and lengths, out,
  num_out, next_token, done, max_out, steps, sampling arrays, the drafter's `DraftState`). The PRNG
  key and the EOS ids are shared by all rows and stay as they are.
- Leaving. A finished (EOS, max_tokens, stop string, stop token) or cancelled request's row is
  marked done by `release_slots`; the step functions leave done rows' results unused, so the slot is
  free for the next insertion. Nothing is copied or compacted.
- Memory. The number of slots is min(--max-batch, what fits), from the bytes one slot needs
  (`slot_bytes`, computed from the config); the prefix cache gets what the slots leave (or
  --prefix-cache-gb). `plan_memory` splits min(free device memory, --memory-gb) between them;
  `plan_by_mode` does the same for every mode (`Scheduler.plans`: start-up table, /metrics).
- Host side, per request: incremental detokenisation that never splits a UTF-8 character
  (`IncrementalDetokenizer`), stop strings matched across deltas by holding back a possible stop
  prefix (`StopMatcher`), per-request stop token ids, cancellation at any time.

Sampling seeds: all rows share one PRNG stream (`DecodeState.key`, split once per step for the
whole batch), so a per-request seed cannot be honoured exactly. What is done: the request's seed
keys its own prefill, so the FIRST token is a pure function of (prompt, sampling params, seed);
later tokens come from the shared stream and depend on what else is running. Greedy requests are
deterministic regardless. Exact per-request seeds need one key per row in `DecodeState` (a change
to `sampling.sample` and the acceptance).

Not done yet:
- batched prefill of several new requests in one call, or a prefill piece fused into the decode
  step (a piece now runs between segments, so it still adds its time to the running rows' TPOT);
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bole_jax.measure import calibrate as calibrate_mod
from bole_jax.model import logits as lm_logits
from bole_jax.model.cache import settle_cache
from bole_jax.model.mtp import MissingMTPError, require_mtp
from bole_jax.pallas.tree_utils import next_pow2
from bole_jax.sampling import validate_sampling
from bole_jax.serving.memory import (
    FixedStats,
    SlotDoesNotFit,
    kv_capacity,
    plan_by_mode,
    plan_memory,
)
from bole_jax.serving.metrics import Metrics
from bole_jax.serving.prefix_cache import (
    Entry,
    PrefixCache,
    block_bytes,
    restore_checkpoint,
    restore_kv,
    take_block,
)
from bole_jax.serving.requests import (
    Request,
    RequestError,
    RequestParams,
    TokenLogprob,
)
from bole_jax.spec_decode import drafter, loop
from bole_jax.spec_decode.loop import DecodeState, Logprobs, token_logprobs
from bole_jax.spec_decode.step import SPEC_MODES

log = logging.getLogger("bole_jax.serving")

DEFAULT_MAX_CONTEXT = 8192  # when neither --max-context nor a smaller max_position_embeddings
MIN_PIECE = 64  # smallest prefill piece width (a prompt's last piece is bucketed from here)


# ------------------------------------------------------------------ jitted slot surgery
def _with_greedy(state: DecodeState, greedy: bool) -> DecodeState:
    """The state with its sampling's static greedy flag set (host only: the arrays are shared)."""
    return dataclasses.replace(state, sampling=dataclasses.replace(state.sampling, greedy=greedy))


def _shared_fields_cleared(state: DecodeState) -> DecodeState:
    return dataclasses.replace(state, key=None, eos=None)


@functools.partial(jax.jit, donate_argnames=("state",))
def insert_slot(state: DecodeState, row: DecodeState, slot: jax.Array) -> DecodeState:
    """Write the batch-1 state `row` into row `slot` of `state` (every batched leaf, axis 0).

    `row` must come from `LLM.state_after_prefill` with the same mode and capacity (and its `out`
    widened to the state's); the PRNG key and EOS ids of `state` are kept.
    Lazy bole commit: the slot's pending commit is overwritten by the row's, and the row's is
    folded into its state first (`settle_cache`; one is empty after a prefill anyway), so the new
    request leaves nothing pending in the slot and the previous occupant's rows are gone.
    """
    row = dataclasses.replace(row, cache=settle_cache(row.cache))
    put = lambda big, small: jax.lax.dynamic_update_slice_in_dim(
        big, small.astype(big.dtype), slot, 0
    )
    new = jax.tree.map(put, _shared_fields_cleared(state), _shared_fields_cleared(row))
    return dataclasses.replace(new, key=state.key, eos=state.eos)


@functools.partial(jax.jit, donate_argnames=("state",))
def release_slots(state: DecodeState, mask: jax.Array) -> DecodeState:
    """Mark rows `mask [B]` done (free). Their temperature is reset to 0 so that a batch whose live
    rows are all greedy keeps the argmax-only sampling path."""
    sp = state.sampling
    sp = dataclasses.replace(sp, temperature=jnp.where(mask, 0.0, sp.temperature))
    return dataclasses.replace(state, done=state.done | mask, sampling=sp)


@functools.partial(jax.jit, static_argnames=("width",))
def read_new_logprobs(state: DecodeState, start: jax.Array, *, width: int):
    """The `Logprobs` of out[b, start[b] : start[b] + width]: [B, width], [B, width, K] twice."""
    lp = state.logprobs
    idx = jnp.minimum(
        start[:, None] + jnp.arange(width, dtype=jnp.int32)[None], lp.logp.shape[1] - 1
    )
    return (
        jnp.take_along_axis(lp.logp, idx, axis=1),
        jnp.take_along_axis(lp.top_ids, idx[..., None], axis=1),
        jnp.take_along_axis(lp.top_logp, idx[..., None], axis=1),
    )


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def first_logprobs(params, h_last: jax.Array, token: jax.Array, *, cfg, k: int):
    """Target log-probabilities of the first token [1] (drawn from the prompt's last hidden [1, H])."""
    return token_logprobs(lm_logits(params, cfg, h_last), token, k)


@functools.partial(jax.jit, static_argnames=("width",))
def read_new_tokens(state: DecodeState, start: jax.Array, *, width: int):
    """Tokens out[b, start[b] : start[b] + width] ([B, width], -1 past the end), num_out, done, steps."""
    idx = jnp.minimum(
        start[:, None] + jnp.arange(width, dtype=jnp.int32)[None], state.out.shape[1] - 1
    )
    return jnp.take_along_axis(state.out, idx, axis=1), state.num_out, state.done, state.steps


# ------------------------------------------------------------------ host-side text


# ------------------------------------------------------------------ the engine
@dataclasses.dataclass(eq=False)
class PrefillJob:
    """A request whose prompt is prefilled piece by piece between decode segments (batch 1).

    cache, draft_kv: its target cache (KV capacity = the slots') and MTP cache, donated by every piece.
    h_last:  [1, H] hidden state of its last prefilled token (zeros before the first piece).
    pos:     prompt tokens in `cache` (restored from the prefix cache or computed); a multiple of
             the block size until the last piece.
    parent:  the prefix-cache entry of the block ending at `pos` (the next full block is stored
             under it), None at the start of the prompt.
    chained: False once a block could not be stored (budget): later blocks would be unreachable.
    branch:  index of the block ending the prompt's matched chain when that block held no
             checkpoint (it is recomputed, and given one), else None.
    """

    req: Request
    cache: Any
    draft_kv: Any
    h_last: jax.Array
    pos: int = 0
    parent: Entry | None = None
    chained: bool = True
    branch: int | None = None


class Scheduler:
    """Continuous-batching engine over `num_slots` decode rows of one `LLM`.

    Args:
      llm: a loaded `bole_jax.LLM` (its spec_options fix the tree shape of the spec modes).
      mode: "ar", "bole", "pernode" or "chain" (default: the calibration table's choice for
        max_batch, else ar; `measure.calibrate.decode_mode`). The mode (where not given) and the
        tree shape are looked up at max_batch, then once more at the slots the memory plan
        admits where those are a smaller batch bucket (the first choice stays where the second
        leaves no slot).
      max_batch: upper bound on the slots (decode rows); memory may allow fewer.
      max_context: prompt + max_tokens limit per request (default: min(max_position_embeddings,
        8192 - slack - 1), i.e. a KV capacity of 8192; slack = verified nodes per step, 0 for ar).
      segment_steps: decode steps per jitted segment, at most (smaller: lower latency to join/leave
        and finer streaming; larger: fewer host round trips).
      slot_group: rows per decode group (see "Decode groups" above); None or >= the slots: one
        group.
      segment_ms: target duration of one segment in milliseconds: the steps per segment follow
        segment_ms / (measured seconds per step), clamped to [1, segment_steps]; the first segment
        runs one step. None: always `segment_steps`.
      prefill_chunk: prompt tokens prefilled per iteration between two decode segments (rounded
        up to whole `prefix_block` pieces): bounds how long a long prompt holds the running rows.
      prefix_block: tokens per prefix-cache block, which is also the prefill piece (a checkpoint of
        the recurrent state is taken after every full block).
      prefix_cache_gb: prefix cache budget in GiB (0 = off; default: the memory the slots leave, see
        `plan_memory`).
      prefix_checkpoints: which prefix-cache entries keep a recurrent-state checkpoint: "sparse"
        (prompt ends and branch points) or "every" block (prefix_cache.py).
      memory_gb: cap in GiB on what slots + prefix cache may use (default: no cap beyond the free
        device memory).
      memory_fraction: share of the free device memory the slots and the prefix cache may use.
      seed: seed of the engine's shared PRNG stream.
      static_greedy: also compile each decode group's all-greedy program, which a group whose live
        requests all have temperature 0 runs (no sampling branch, no per-step `lax.cond`:
        `SamplingParams.greedy`); costs a second segment compile at start-up. None: on GPUs.
      max_logprobs: record the target log-probability of every generated token and the
        `max_logprobs` most likely tokens at its position (requests may ask for up to that many);
        None: not recorded (requests asking for logprobs are refused). Costs a log-softmax and a
        top-k over the vocabulary for every verified position of every step.
    Use `start()` / `stop()` for the engine thread, `submit()` from any thread.
    """

    def __init__(
        self,
        llm,
        *,
        mode: str | None = None,
        max_batch: int = 8,
        max_context: int | None = None,
        segment_steps: int = 8,
        segment_ms: float | None = 100.0,
        prefill_chunk: int = 1024,
        prefix_block: int = 256,
        prefix_cache_gb: float | None = None,
        prefix_checkpoints: str = "sparse",
        memory_gb: float | None = None,
        memory_fraction: float = 0.9,
        max_waiting: int = 4096,
        seed: int = 0,
        max_logprobs: int | None = None,
        slot_group: int | None = None,
        static_greedy: bool | None = None,
    ):
        self.llm = llm
        cfg = llm.cfg
        if segment_steps < 1:
            raise ValueError(f"segment_steps must be >= 1, got {segment_steps}")
        if slot_group is not None and (type(slot_group) is not int or slot_group < 1):
            raise ValueError(
                f"--slot-group must be an integer >= 1 (rows per group), got {slot_group!r}"
            )
        self.slot_group = slot_group
        limit = cfg.max_position_embeddings
        if max_context is not None and not 2 <= max_context <= limit:
            raise ValueError(
                f"--max-context must be in [2, {limit}] (the model's "
                f"max_position_embeddings), got {max_context}"
            )
        if prefix_block < 1:
            raise ValueError(f"--prefix-block must be >= 1 token, got {prefix_block}")
        if prefill_chunk < 1:
            raise ValueError(f"--prefill-chunk must be >= 1 token, got {prefill_chunk}")
        if segment_ms is not None and not segment_ms > 0:
            raise ValueError(f"--segment-ms must be > 0, got {segment_ms}")
        if max_logprobs is not None and not 0 <= max_logprobs <= 20:
            raise ValueError(f"--max-logprobs must be in [0, 20], got {max_logprobs}")
        self.max_logprobs = max_logprobs
        self.dtype = llm.params["embed"].dtype
        # No mode given: the calibrated choice at the slots' batch bucket and KV capacity, as
        # LLM.generate makes it (the table's fastest of ar / chain / bole; ar without a table).
        kv = next_pow2(
            min(cfg.max_position_embeddings, max_context or DEFAULT_MAX_CONTEXT), minimum=64
        )
        self._spec_kv = kv
        # The batch the mode and the tree shape are looked up at: max_batch, then, where the
        # memory plan admits fewer slots in a smaller batch bucket, those slots (once: a 12-slot
        # server decodes the 16-row bucket's choice, not the 64-row one's).
        lookup, first = max_batch, None
        for attempt in (0, 1):
            self._choose(mode, lookup, max_context)
            # Every mode's plan in the same memory (start-up table, /metrics); this engine runs
            # its own.
            self.plans = plan_by_mode(
                cfg,
                self.max_context,
                self._mode_specs(lookup),
                self.dtype,
                max_batch,
                logprobs=max_logprobs,
                memory_gb=memory_gb,
                prefix_cache_gb=prefix_cache_gb,
                memory_fraction=memory_fraction,
                group_rows=slot_group,
            )
            mine = self.plans[self.mode]
            if mine.plan is None:
                if first is None:
                    raise SlotDoesNotFit(mine.error)
                # the smaller bucket's choice needs more memory than the slots leave: keep the
                # first one
                lookup, (self.mode, self.spec, self.max_context, self.capacity, self.plans) = first
                mine = self.plans[self.mode]
                break
            slots = mine.plan.num_slots
            if attempt or next_pow2(slots, minimum=1) >= next_pow2(lookup, minimum=1):
                break
            first = lookup, (self.mode, self.spec, self.max_context, self.capacity, self.plans)
            lookup = slots
        self._spec_batch = lookup
        if max_context is not None:
            tight = self.capacity // 2 - (self.spec.slack if self.spec else 0) - 1
            if tight >= 64 and tight >= 0.9 * max_context:  # a slightly smaller limit halves the KV
                log.warning(
                    "--max-context %d needs a KV capacity of %d per slot; --max-context %d would "
                    "halve the KV memory",
                    max_context,
                    self.capacity,
                    tight,
                )
        if self.mode == "ar" and {"simulate_accept", "simulate_accept_mean"} & set(
            llm.spec_options or {}
        ):
            log.warning("simulated acceptance has no effect in ar mode (pass --spec bole|...)")
        self.segment_steps = segment_steps
        self.segment_ms = segment_ms
        self._step_s: float | None = None  # moving average of one decode step's seconds
        self.prefix_block = prefix_block
        # Whole pieces per iteration; at least one, so a prompt always progresses.
        self.prefill_chunk = -(-prefill_chunk // prefix_block) * prefix_block
        self.max_waiting = max_waiting
        self.tokens_per_step = (self.spec.shape.depth + 1) if self.spec else 1
        # kept for the re-plan from the compiled step (`_fit_step_memory`)
        self._plan_args = dict(
            max_batch=max_batch,
            memory_gb=memory_gb,
            prefix_cache_gb=prefix_cache_gb,
            memory_fraction=memory_fraction,
        )
        self.step_memory: dict | None = None  # the compiled segment's temporaries, once known
        self.slot_bytes, self.memory = mine.slot_bytes, mine.plan
        self.num_slots, self.device_memory = self.memory.num_slots, self.memory.device_stats
        self.prefix_checkpoints = prefix_checkpoints
        self.prefix = self._new_prefix_cache(self.memory.prefix_bytes)
        entry = block_bytes(cfg, prefix_block, self.dtype, mtp=self.spec is not None)
        if self.prefix.enabled and prefix_block > self.max_context - 2:
            log.warning(
                "--prefix-block %d leaves no prompt of this server (at most %d tokens) a whole "
                "block to reuse: nothing will be cached",
                prefix_block,
                self.max_context - 1,
            )
        elif self.prefix.enabled and entry > self.prefix.budget_bytes:
            log.warning(
                "the prefix cache budget (%.1f MiB) is smaller than one block (%.1f MiB): "
                "nothing will be cached (raise --prefix-cache-gb or lower --prefix-block)",
                self.prefix.budget_bytes / 2**20,
                entry / 2**20,
            )
        self.eos = frozenset(int(e) for e in llm.eos_ids if e >= 0)
        self.tokenizer = llm.tokenizer
        self.metrics = Metrics()
        self._segment_jit = llm.segment_fn(self.mode, self._spec_batch, kv)
        # A second program per group shape for segments whose live requests are all greedy
        # (`SamplingParams.greedy`: no per-step lax.cond); None: on GPUs, where it was measured
        # faster (docs/design-decisions.md, "A static greedy program"). The running state itself
        # always carries the mixed flag; a greedy segment gets it set for its call only.
        self.static_greedy = drafter.unroll_levels() if static_greedy is None else static_greedy
        # (smaller last group?, all greedy?) -> the segment program, compiled for the running
        # state by `_ensure_state` (`_compile_segment`); the jit until then
        self._segments = {
            (last, g): self._segment_jit for last in (False, True) for g in (False, True)
        }
        self._seed = seed
        # prefill piece width -> its compiled program (a future while `_compile_prefill`'s threads
        # compile it); a width not in it runs through the jit
        self._prefill_programs: dict[int, Any] = {}
        self.warming_up = False
        # Called with a line per compilation stage of start() (the server prints them: a large
        # model's decode segment compiles for minutes); None: silent.
        self.progress: Callable[[str], None] | None = None
        self.stage: str | None = None  # the last of those lines (/health shows it while starting)
        self._t_start: float | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: collections.deque[Request] = collections.deque()
        self._groups: list[DecodeState] | None = None  # the running state, group by group
        self._set_slots(self.num_slots)
        self._job: PrefillJob | None = None  # the request being prefilled (one at a time)
        self.state_bytes = 0  # bytes of the running state (its shapes never change)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: str | None = None  # set when the engine thread died
        self._queued = 0  # submitted, still in the inbox
        self._queued_lock = threading.Lock()

    def _choose(self, mode: str | None, batch: int, max_context: int | None) -> None:
        """Set the mode (given, else the table's choice at `batch` and the KV capacity), its tree
        shape (`spec`) and, with the shape's slack, `max_context` and the KV `capacity`."""
        llm, cfg, kv = self.llm, self.llm.cfg, self._spec_kv
        self.mode = mode or calibrate_mod.decode_mode(llm, None, batch, kv)
        if self.mode not in ("ar",) + SPEC_MODES:
            raise ValueError(
                f"unknown spec mode {self.mode!r}: expected one of {('ar',) + SPEC_MODES}"
            )
        self.spec = None
        if self.mode != "ar":
            # The tree shape of the batch bucket and KV capacity the slots run at (a calibrated
            # shape when a table matches, else the logged default): the same for the segment, the
            # prefill caches and the rows, so slack and slot memory are sized for the tree
            # actually verified.
            self.spec = llm._spec_config(self.mode, batch, kv=kv)
            if self.spec.synthetic_accept is not None:
                raise ValueError(
                    "the synthetic-acceptance drafter is for offline benchmarks, not serving"
                )
            require_mtp(cfg, llm.params)
        slack = self.spec.slack if self.spec else 0
        limit = cfg.max_position_embeddings
        if max_context is None:
            self.max_context = min(
                limit, next_pow2(min(limit, DEFAULT_MAX_CONTEXT), minimum=64) - slack - 1
            )
        else:
            self.max_context = max_context
        # A power-of-two KV capacity (as start_batch's); the tree needs `slack` extra rows.
        self.capacity = kv_capacity(self.max_context, slack)

    def _mode_specs(self, max_batch: int) -> dict:
        """mode -> SpecConfig (None for ar) of the modes the memory plan compares: ar, and with an
        MTP head chain and pernode / bole on the tree this engine verifies (its own when it runs
        a tree mode, else bole's at this batch)."""
        specs: dict = {"ar": None}
        try:
            require_mtp(self.llm.cfg, self.llm.params)
        except MissingMTPError:
            return specs
        mine = self.spec
        tree = (
            mine
            if self.mode in ("bole", "pernode")
            else self.llm._spec_config("bole", max_batch, quiet=True, kv=self._spec_kv)
        )
        specs["chain"] = (
            mine
            if self.mode == "chain"
            else self.llm._spec_config("chain", max_batch, quiet=True, kv=self._spec_kv)
        )
        specs["pernode"] = dataclasses.replace(tree, mode="pernode")
        specs["bole"] = dataclasses.replace(tree, mode="bole")
        return specs

    # ---------------------------------------------------------------- client API (any thread)
    def check(self, prompt_ids: Sequence[int], params: RequestParams) -> None:
        """Raise RequestError for what the client got wrong (the HTTP layer answers 400)."""
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty (after tokenisation)", "prompt")
        vocab = self.llm.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}", "prompt")
        if (
            isinstance(params.max_tokens, bool)
            or not isinstance(params.max_tokens, int)
            or params.max_tokens < 1
        ):
            raise RequestError(
                f"max_tokens must be an integer >= 1, got {params.max_tokens!r}", "max_tokens"
            )
        if n + params.max_tokens > self.max_context:
            raise RequestError(
                f"this server's maximum context length is {self.max_context} tokens, but "
                f"{n + params.max_tokens} were requested ({n} in the prompt, {params.max_tokens} for "
                "the completion): shorten the prompt or lower max_tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        try:
            validate_sampling(params.temperature, params.top_p, params.top_k)
        except ValueError as e:
            raise RequestError(str(e), str(e).split()[0]) from None
        if any(not isinstance(s, str) or not s for s in params.stop):
            raise RequestError("stop strings must be non-empty strings", "stop")
        if params.logprobs is not None:
            if self.max_logprobs is None:
                raise RequestError(
                    "this server does not record logprobs: start it with --max-logprobs K",
                    "logprobs",
                )
            if not 0 <= params.logprobs <= self.max_logprobs:
                raise RequestError(
                    f"at most {self.max_logprobs} top logprobs per token on this server "
                    f"(--max-logprobs), got {params.logprobs}",
                    "logprobs",
                )

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: RequestParams,
        *,
        events: queue.Queue | None = None,
        index: int = 0,
    ) -> Request:
        """Validate and enqueue a request (token ids). `events`: a queue shared by several requests
        (their `Delta.index` tells them apart); by default the request has its own."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.check(prompt_ids, params)
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error}")
        if self.queue_depth >= self.max_waiting:
            raise OverflowError(f"too many waiting requests ({self.max_waiting}): retry later")
        req = Request(
            prompt_ids, params, self.tokenizer, events=events, index=index, inbox=self._inbox
        )
        with self._queued_lock:
            self._queued += 1
        self._inbox.put(("add", req))
        return req

    @property
    def queue_depth(self) -> int:
        """Requests submitted and not yet in a slot (nor finished), the one being prefilled included."""
        return len(self._waiting) + self._queued + (self._job is not None)

    @property
    def active_slots(self) -> int:
        return sum(r is not None for r in self._slots)

    @property
    def prefilling(self) -> Request | None:
        """The request whose prompt is being prefilled (between decode segments), if any."""
        job = self._job
        return None if job is None else job.req

    def start(self, warmup: bool = True) -> "Scheduler":
        """Compile (`warmup`) and start the engine thread."""
        if self._thread is None:
            self._t_start = time.perf_counter()
            if warmup:
                self.warming_up = True  # /health: 503 "starting" until the engine runs
                try:
                    self.warmup()
                finally:
                    self.warming_up = False
            self._ensure_state()
            self._note("done")
            self._thread = threading.Thread(target=self._run, name="bole-engine", daemon=True)
            self._thread.start()
        return self

    def _note(self, what: str) -> None:
        """Report a compilation stage of start() to `progress` (and keep it in `stage`), with the
        seconds since start()."""
        if self._t_start is None:
            return
        self.stage = f"[{time.perf_counter() - self._t_start:6.1f} s] {what}"
        if self.progress is not None:
            self.progress(self.stage)

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._fail_all("cancelled")
        if self._groups is not None and self.error is None:  # free every row (start() may follow)
            self._release(list(range(self.num_slots)))

    def _fail_all(self, reason: str, error: str | None = None) -> None:
        """Finish every request the engine knows of (queued, waiting, prefilling, running)."""
        pending = []
        try:
            while True:
                kind, req = self._inbox.get_nowait()
                if kind == "add":
                    with self._queued_lock:
                        self._queued -= 1
                    pending.append(req)
        except queue.Empty:
            pass
        job, self._job = self._job, None
        pending += [job.req] if job is not None else []
        for r in pending + list(self._waiting) + [r for r in self._slots if r is not None]:
            self._end(r, reason, error)
        self._waiting.clear()
        self._slots = [None] * self.num_slots

    def warmup(self) -> None:
        """Compile every prefill piece shape, the prefix-cache copies, the first-token sampling,
        insertion, one segment, the readback and the release (engine idle)."""
        assert self.active_slots == 0 and self._job is None, "warm up before serving"
        self._ensure_state()
        longest = self.max_context - 1  # the longest prompt (max_tokens >= 1)
        lengths = sorted({min(t, longest) for t in self._piece_sizes()})
        p = self.prefix_block
        prompts = [[1] * n for n in lengths]
        if p < longest:  # a full block and a partial piece, twice: checkpoint, restore
            prompts += [[1] * (p + 1)] * 2
        if 2 * p < longest and self.prefix_checkpoints == "sparse":
            # a block kept without its checkpoint, then one given it (a branch)
            prompts += [[3] * (2 * p + 1), [3] * p + [4] * (p + 1)]
        row = None
        for i, ids in enumerate(prompts):
            self._note(f"prefill {i + 1}/{len(prompts)} ({len(ids)} tokens)")
            row, _ = self._prefill_now(
                Request(ids, RequestParams(max_tokens=1), None, internal=True)
            )
        self.prefix = self._new_prefix_cache(self.prefix.budget_bytes)  # forget the dummies
        width = self.segment_steps * self.tokens_per_step
        spans, rows = self._spans(), self._group_rows()
        for g in [0] if rows[-1] == rows[0] else [0, len(rows) - 1]:  # each group shape once
            self._note(f"first decode segment ({rows[g]} rows)")
            first, end = spans[g]
            st = insert_slot(self._groups[g], row, jnp.int32(0))
            st = self._segment_of(end - first)(self.llm.params, st, jnp.int32(self.segment_steps))
            seen = jnp.asarray(self._seen[first:end])
            jax.block_until_ready(read_new_tokens(st, seen, width=width))
            if self.max_logprobs is not None:
                jax.block_until_ready(read_new_logprobs(st, seen, width=width))
            self._groups[g] = st
            self._release([first])
            self._steps[first] = 0

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.step(block=True)
        except Exception as e:  # the state was donated: nothing sensible is left to continue with
            log.exception("engine thread died")
            self.error = f"{type(e).__name__}: {e}"
            self._fail_all("error", self.error)

    def step(self, block: bool = False) -> None:
        """One engine iteration: take new requests and cancellations, prefill up to `prefill_chunk`
        prompt tokens (admitting the requests whose prefill completes), decode one segment."""
        idle = self.active_slots == 0 and not self._waiting and self._job is None
        self._drain_inbox(timeout=0.5 if (block and idle) else None)
        self._ensure_state()
        self._admit()
        if self.active_slots:
            self._decode()

    def _drain_inbox(self, timeout: float | None) -> None:
        msgs = []
        try:
            msgs.append(self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait())
            while True:
                msgs.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        free = []
        for kind, req in msgs:
            if kind == "add":
                with self._queued_lock:
                    self._queued -= 1
                self._waiting.append(req)
            elif kind == "cancel" and not req.finished:
                if req in self._waiting:
                    self._waiting.remove(req)
                elif self._job is not None and self._job.req is req:
                    self._job = None  # its batch-1 caches go with it; no slot was taken yet
                elif req in self._slots:
                    free.append(self._slots.index(req))
                self._end(req, "cancelled")
        self._release(free)

    @property
    def _state(self) -> DecodeState | None:
        """The running state when it is one group (tests and tools; see `_groups`)."""
        if self._groups is None:
            return None
        assert len(self._groups) == 1, "the slots are split into decode groups: see _groups"
        return self._groups[0]

    def _spans(self) -> list[tuple[int, int]]:
        """The slots [first, end) of each decode group: `group_size` each, the last what remains."""
        g, n = self.group_size, self.num_slots
        return [(lo, min(lo + g, n)) for lo in range(0, n, g)]

    def _group_rows(self) -> list[int]:
        return [hi - lo for lo, hi in self._spans()]

    def _where(self, slot: int) -> tuple[int, int]:
        """(group, row in the group) of a slot."""
        return divmod(slot, self.group_size)

    def _segment_of(self, rows: int, greedy: bool = False):
        return self._segments[rows != self.group_size, greedy]

    def _all_greedy(self, lo: int, hi: int) -> bool:
        """Whether slots [lo, hi) run the greedy program: every live request's temperature is 0."""
        return self.static_greedy and all(
            r.params.temperature <= 0.0 for r in self._slots[lo:hi] if r is not None
        )

    def _set_slots(self, n: int) -> None:
        self.num_slots = n
        self.group_size = min(self.slot_group or n, n)
        self._slots: list[Request | None] = [None] * n
        self._seen = np.zeros(n, np.int32)  # tokens of each slot already on the host
        self._steps = np.zeros(n, np.int32)  # host copy of state.steps at the last read

    def _ensure_state(self) -> None:
        """The running state: every slot a copy of a 1-token dummy row, all done (free). The first
        time, the decode segment is compiled for it and the slots re-planned with the compiled
        step's temporary memory (`_fit_step_memory`)."""
        if self._groups is not None:
            return
        if not self._prefill_programs:
            self._compile_prefill()
        self._note(f"decode state ({self.num_slots} slots)")
        self._build_state()
        if self.step_memory is None:
            self._fit_step_memory()

    def _build_state(self) -> None:
        row, _ = self._prefill_now(Request([1], RequestParams(max_tokens=1), None, internal=True))
        self._groups = []
        for g, b in enumerate(self._group_rows()):
            state = jax.tree.map(lambda x: jnp.repeat(x, b, axis=0), _shared_fields_cleared(row))
            key = jax.random.key(self._seed)
            self._groups.append(
                dataclasses.replace(
                    state,
                    key=key if g == 0 else jax.random.fold_in(key, g),
                    eos=jnp.copy(row.eos),  # each group's own: a segment donates its state
                    done=jnp.ones((b,), bool),
                )
            )
        self.state_bytes = sum(
            x.nbytes for st in self._groups for x in jax.tree.leaves(_shared_fields_cleared(st))
        )

    def _compile_prefill(self) -> None:
        """Start compiling the prefill program of every piece width (`_piece_sizes`): traced here
        one after another, compiled in threads (XLA compiles outside the GIL) while start-up goes
        on; `_prefill_piece` waits for its width's program. At Qwen3.5-27B dims each width
        compiles for about 40 s (its 64 layers unrolled)."""
        self._note("prefill programs")
        cache, draft_kv = self.llm.prefill_caches(
            1, self.capacity, mode=self.mode, spec_batch=self._spec_batch, spec_kv=self._spec_kv
        )
        h = jnp.zeros((1, self.llm.cfg.hidden_size), self.dtype)
        lowered = {
            w: loop.prefill_chunk.lower(
                self.llm.params,
                cache,
                jnp.zeros((1, w), jnp.int32),
                jnp.ones((1,), jnp.int32),
                h,
                draft_kv,
                cfg=self.llm.cfg,
            )
            for w in self._piece_sizes()
        }
        pool = concurrent.futures.ThreadPoolExecutor(len(lowered), "bole-compile")
        self._prefill_programs = {w: pool.submit(low.compile) for w, low in lowered.items()}
        pool.shutdown(wait=False)

    def _prefill_program(self, width: int):
        """The compiled prefill program of a piece width (waiting for its compile), else the jit."""
        prog = self._prefill_programs.get(width)
        if isinstance(prog, concurrent.futures.Future):
            try:
                prog = prog.result()
            except Exception:  # noqa: BLE001 - the jit compiles it again on its first call
                log.warning("compiling the %d-token prefill program failed", width, exc_info=True)
                prog = None
            self._prefill_programs[width] = prog
        if prog is None:
            return functools.partial(loop.prefill_chunk, cfg=self.llm.cfg)
        return prog

    def _compile_segment(self) -> int | None:
        """Compile the decode segment for the running state's groups (their shapes never change:
        one program for groups of `group_size` rows, one for a smaller last group), with
        `static_greedy` their greedy programs too, and return the bytes of the largest one's
        temporaries (the groups run one after another; None: the backend reports none). The
        programs are traced here one after another and compiled at the same time, one thread
        each (XLA compiles outside the GIL)."""
        sizes = self._group_rows()
        jobs = [
            (g, greedy)
            for g in sorted({0, len(sizes) - 1})
            for greedy in ((False, True) if self.static_greedy else (False,))
        ]
        lowered = []
        for g, greedy in jobs:
            self._note(
                f"decode segment ({sizes[g]} rows, {self.segment_steps} steps"
                + (", greedy)" if greedy else ")")
            )
            state = _with_greedy(self._groups[g], greedy)
            lowered.append(
                self._segment_jit.lower(self.llm.params, state, jnp.int32(self.segment_steps))
            )
        if len(lowered) == 1:
            programs = [lowered[0].compile()]
        else:
            with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
                programs = list(pool.map(lambda low: low.compile(), lowered))
        temps = []
        for (g, greedy), compiled in zip(jobs, programs):
            temps.append(calibrate_mod.temp_bytes(compiled))
            for last in (False, True) if g == 0 else (True,):  # the last group's until its own
                self._segments[last, greedy] = compiled
        return None if None in temps else max(temps)

    def _fit_step_memory(self) -> None:
        """Take the step's transient memory from the compiled decode segment rather than the
        estimate: the plan's `step_transient` counts the verify's outputs (logits, factors or
        per-node states) but not the activations, the drafter's logits or sampling's work, which
        the compiled program's temporaries do. Where they exceed the estimate, each slot is
        charged temporaries / slots instead (with decode groups: the plan holds one group's
        temporaries once) and the slots are planned again in the same memory (the device reading
        taken at start-up); with fewer slots the state is rebuilt and the segment compiled once
        more. Bounded: one re-plan. Where the usable memory is unknown (CPU without --memory-gb)
        the temporaries are only recorded (`stats()["step_memory"]`)."""
        temp = self._compile_segment()
        est = self.slot_bytes["step_transient"]
        grouped = self.slot_group is not None  # planned with one group's step transient, shared
        planned = self.memory.shared_bytes if grouped else est * self.num_slots
        self.step_memory = dict(
            compiled_temp_bytes=temp,
            estimate_bytes=planned,
            planned_slots=self.num_slots,
            slots=self.num_slots,
            group_rows=self.group_size,
        )
        if temp is None or self.memory.usable_bytes is None:
            return  # the memory is unknown: nothing to fit
        if (temp <= planned) if grouped else (-(-temp // self.num_slots) <= est):
            return  # the estimate covers the step
        if grouped:
            parts, per_slot, shared = self.slot_bytes, self.memory.slot_bytes, temp
        else:
            parts = dict(self.slot_bytes, step_transient=-(-temp // self.num_slots))
            per_slot, shared = sum(parts.values()), 0
        try:
            plan = plan_memory(
                per_slot,
                self._plan_args["max_batch"],
                memory_gb=self._plan_args["memory_gb"],
                prefix_cache_gb=self._plan_args["prefix_cache_gb"],
                device=FixedStats(self.memory.device_stats),
                memory_fraction=self._plan_args["memory_fraction"],
                shared_bytes=shared,
            )
        except SlotDoesNotFit as e:
            where = (
                f"one decode group of {self.group_size} rows"
                if grouped
                else f"{self.num_slots} slots, {parts['step_transient'] / 2**20:.2f} MiB per slot"
            )
            raise SlotDoesNotFit(
                f"with the compiled decode step's temporaries ({temp / 2**20:.1f} MiB at "
                f"{where}): {e}"
            ) from None
        before = self.num_slots
        self.slot_bytes, self.memory = parts, plan
        old = self.plans[self.mode]
        self.plans[self.mode] = dataclasses.replace(old, slot_bytes=parts, plan=plan)
        self.prefix = self._new_prefix_cache(plan.prefix_bytes)
        if plan.num_slots < before:
            log.warning(
                "the compiled decode step needs %.1f MiB of temporaries at %d slots (estimate %.1f "
                "MiB): %d slots fit the memory, not %d",
                temp / 2**20,
                before,
                planned / 2**20,
                plan.num_slots,
                before,
            )
            self._groups = None
            self._set_slots(plan.num_slots)
            self._build_state()
            temp2 = self._compile_segment()
            self.step_memory.update(
                slots=plan.num_slots, group_rows=self.group_size, recompiled_temp_bytes=temp2
            )
        else:
            log.info(
                "the compiled decode step needs %.1f MiB of temporaries (estimate %.1f MiB); the "
                "%d slots still fit",
                temp / 2**20,
                planned / 2**20,
                before,
            )

    # ---------------------------------------------------------------- chunked prefill
    def _piece_width(self, w: int) -> int:
        """Compiled width of a piece of `w` prompt tokens: the block, or for a prompt's last (partial)
        piece a power-of-two bucket (from 64) below it."""
        p = self.prefix_block
        return p if w == p else min(p, next_pow2(w, minimum=min(p, MIN_PIECE)))

    def _piece_sizes(self) -> list[int]:
        """Every width `_piece_width` gives for this engine's prompts (compiled by `warmup`)."""
        return sorted(
            {
                self._piece_width(w)
                for w in range(1, min(self.prefix_block, self.max_context - 1) + 1)
            }
        )

    def _new_prefix_cache(self, budget_bytes: int) -> PrefixCache:
        return PrefixCache(self.prefix_block, budget_bytes, self.prefix_checkpoints)

    def _new_job(self, req: Request) -> "PrefillJob":
        """Start prefilling `req`: fresh batch-1 caches of the slots' capacity, then the longest
        cached prefix restored into them (KV rows of every block, the checkpoint of the last)."""
        cache, draft_kv = self.llm.prefill_caches(
            1, self.capacity, mode=self.mode, spec_batch=self._spec_batch, spec_kv=self._spec_kv
        )
        job = PrefillJob(req, cache, draft_kv, jnp.zeros((1, self.llm.cfg.hidden_size), self.dtype))
        if not self.prefix.enabled:
            return job
        chain, job.branch = self.prefix.resume(req.prompt_ids)
        p = self.prefix_block
        for i, e in enumerate(chain):
            job.cache, job.draft_kv = restore_kv(job.cache, job.draft_kv, e.block, jnp.int32(i * p))
        if chain:
            job.cache = restore_checkpoint(job.cache, chain[-1].block, jnp.int32(len(chain) * p))
            job.h_last = chain[-1].block.h_last  # never donated (prefill_chunk reads it)
            job.pos, job.parent = len(chain) * p, chain[-1]
        req.cached_tokens = req.prefilled = job.pos
        if not req.internal:
            with self.metrics.lock:
                self.metrics.prefix_queries += 1
                self.metrics.prefix_hits += job.pos > 0
                self.metrics.prefix_query_tokens += len(req.prompt_ids)
                self.metrics.prefix_cached_tokens += job.pos
        return job

    def _prefill_piece(self, job: "PrefillJob") -> int:
        """Prefill the job's next piece (up to one block, ending on a block boundary) and checkpoint
        a completed block into the prefix cache. Returns the prompt tokens prefilled."""
        ids, p = job.req.prompt_ids, self.prefix_block
        start = job.pos
        w = min(p, len(ids) - start)
        piece = np.zeros((1, self._piece_width(w)), np.int32)
        piece[0, :w] = ids[start : start + w]
        job.h_last, job.cache, job.draft_kv = self._prefill_program(piece.shape[1])(
            self.llm.params,
            job.cache,
            jnp.asarray(piece),
            jnp.full((1,), w, jnp.int32),
            job.h_last,
            job.draft_kv,
        )
        job.pos = job.req.prefilled = start + w
        if w == p and job.chained and self.prefix.enabled:
            take = functools.partial(
                take_block, job.cache, job.draft_kv, job.h_last, jnp.int32(start), size=p
            )
            entry = self.prefix.store(job.parent, ids, start, job.branch, take)
            job.parent, job.chained = (
                entry,
                entry is not None,
            )  # a gap ends the chain for this prompt
        if not job.req.internal:
            with self.metrics.lock:
                self.metrics.prefill_tokens += w
                self.metrics.prefill_pieces += 1
        return w

    def _row(self, job: "PrefillJob") -> tuple[DecodeState, int]:
        """The prefilled job as a row of the running state's shapes -> (row, first token)."""
        p = job.req.params
        # max_new = 1 gives start_batch's layout; out, max_out and done are restated below.
        row = self.llm.state_after_prefill(
            job.cache,
            job.draft_kv,
            job.h_last,
            1,
            1,
            mode=self.mode,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            spec_batch=self._spec_batch,
            spec_kv=self._spec_kv,
            static_greedy=False,  # one program for the running batch, whatever its requests
        )
        assert row.cache.capacity == self.capacity, (row.cache.capacity, self.capacity)
        tok0 = int(row.next_token[0])
        out = np.full((1, self.max_context), -1, np.int32)
        out[0, 0] = tok0
        row = dataclasses.replace(
            row,
            out=jnp.asarray(out),
            max_out=jnp.full((1,), p.max_tokens, jnp.int32),
            done=jnp.zeros((1,), bool),
        )
        if self.max_logprobs is not None:
            k = self.max_logprobs
            logp, ids, lps = first_logprobs(
                self.llm.params, job.h_last, row.next_token, cfg=self.llm.cfg, k=k
            )
            buf = Logprobs.zeros(1, self.max_context, k)
            buf = Logprobs(
                buf.logp.at[0, 0].set(logp[0]),
                buf.top_ids.at[0, 0].set(ids[0]),
                buf.top_logp.at[0, 0].set(lps[0]),
            )
            row = dataclasses.replace(row, logprobs=buf)
            if job.req.logprobs is not None:
                job.req.first_logprob = _entry(tok0, *jax.device_get((logp[0], ids[0], lps[0])))
        return row, tok0

    def _prefill_now(self, req: Request) -> tuple[DecodeState, int]:
        """Prefill a whole prompt at once (engine-made dummy rows and warm-up)."""
        job = self._new_job(req)
        while job.pos < len(req.prompt_ids):
            self._prefill_piece(job)
        return self._row(job)

    def _admit(self) -> None:
        """This iteration's prefill: up to `prefill_chunk` prompt tokens, in pieces, one request at
        a time (chosen by `_next_waiting`, continued next iteration when its prompt is longer). A
        request whose prefill completes takes a free slot. A request is only started while a slot is
        free, so a completed prefill always finds one."""
        budget = self.prefill_chunk
        t0 = time.perf_counter()
        pieces = 0
        while budget > 0:
            if self._job is None and not self._start_next():
                break
            job = self._job
            try:
                budget -= self._prefill_piece(job)
                pieces += 1
                row = self._row(job) if job.pos == len(job.req.prompt_ids) else None
            except Exception as e:  # a failed prefill must not take the engine down
                log.exception("prefill failed")
                self._job = None
                self._end(job.req, "error", f"prefill failed: {type(e).__name__}: {e}")
                continue
            if row is not None:
                self._job = None
                self._admit_one(job.req, *row)
        if pieces:
            if self._job is not None:
                jax.block_until_ready(self._job.h_last)  # time the device work, not its dispatch
            with self.metrics.lock:
                self.metrics.prefill_seconds += time.perf_counter() - t0

    def _next_waiting(self) -> Request:
        """Take the waiting request to start next: the oldest of the HTTP request (the requests
        sharing one event queue: a request's prompts and `n` choices) that holds the fewest slots.
        A request of many prompts or choices thus takes turns with the others instead of queueing
        them behind all of its own; with one engine request each this is FIFO."""
        held: dict[int, int] = {}
        for r in self._slots:
            if r is not None:
                held[id(r.events)] = held.get(id(r.events), 0) + 1
        if not held:
            return self._waiting.popleft()
        best, fewest = 0, None
        for i, r in enumerate(self._waiting):
            n = held.get(id(r.events), 0)
            if fewest is None or n < fewest:
                best, fewest = i, n
                if n == 0:
                    break
        req = self._waiting[best]
        del self._waiting[best]
        return req

    def _start_next(self) -> bool:
        """Start the next waiting request's prefill if a slot is free. False when none can start."""
        while self._waiting and None in self._slots:
            req = self._next_waiting()
            if req.cancelled:
                self._end(req, "cancelled")
                continue
            try:
                self._job = self._new_job(req)
            except Exception as e:
                log.exception("prefill failed")
                self._end(req, "error", f"prefill failed: {type(e).__name__}: {e}")
                continue
            return True
        return False

    def _admit_one(self, req: Request, row: DecodeState, tok0: int) -> None:
        """Hand a prefilled request its first token and insert its row into a free slot."""
        req.t_first = time.perf_counter()
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(req.prompt_ids)
        reason = req._consume(tok0, self.eos, req.first_logprob)
        if reason is not None:
            self._end(req, reason)
            return
        slot = self._slots.index(None)  # the lowest free slot: requests gather in the first groups
        g, r = self._where(slot)
        self._groups[g] = insert_slot(self._groups[g], row, jnp.int32(r))
        self._slots[slot] = req
        self._seen[slot] = 1
        self._steps[slot] = 0

    def _decode(self) -> None:
        """One segment for every decode group holding a request (all dispatched before the first
        readback), then hand the new tokens to their requests."""
        t0 = time.perf_counter()
        n = self.next_segment_steps()
        width = self.segment_steps * self.tokens_per_step
        spans = self._spans()
        busy = [g for g, (lo, hi) in enumerate(spans) if any(self._slots[lo:hi])]
        greedy_runs = 0
        for g in busy:
            lo, hi = spans[g]
            greedy = self._all_greedy(lo, hi)
            out = self._segment_of(hi - lo, greedy)(
                self.llm.params, _with_greedy(self._groups[g], greedy), jnp.int32(n)
            )
            self._groups[g] = _with_greedy(out, False)
            greedy_runs += greedy
        want_lp = self.max_logprobs is not None and any(
            r is not None and r.logprobs is not None for r in self._slots
        )
        window = np.zeros((self.num_slots, width), np.int32)
        num_out, done, steps = (
            np.array(self._seen),
            np.ones(self.num_slots, bool),
            self._steps.copy(),
        )
        lps = None
        for g in busy:
            lo, hi = spans[g]
            seen = jnp.asarray(self._seen[lo:hi])
            got = jax.device_get(read_new_tokens(self._groups[g], seen, width=width))
            window[lo:hi], num_out[lo:hi], done[lo:hi], steps[lo:hi] = got
            if want_lp:
                lp = jax.device_get(read_new_logprobs(self._groups[g], seen, width=width))
                if lps is None:
                    lps = tuple(np.zeros((self.num_slots,) + x.shape[1:], x.dtype) for x in lp)
                for dst, src in zip(lps, lp):
                    dst[lo:hi] = src
        dt = time.perf_counter() - t0
        # A segment whose rows all finish early ran fewer steps: the estimate errs towards shorter
        # steps, i.e. a longer next segment, bounded by segment_steps.
        self._step_s = dt / n if self._step_s is None else 0.7 * self._step_s + 0.3 * dt / n
        with self.metrics.lock:
            self.metrics.segments += 1
            self.metrics.greedy_segments += greedy_runs
            self.metrics.segment_seconds += dt
            self.metrics.segment_steps += n
        free = []
        for slot, req in enumerate(self._slots):
            if req is None:
                continue
            new = int(num_out[slot] - self._seen[slot])
            assert 0 <= new <= width, (new, width)
            took = int(steps[slot] - self._steps[slot])
            req.steps += took
            with self.metrics.lock:
                self.metrics.decode_tokens += new
                self.metrics.slot_steps += took
            self._seen[slot] = num_out[slot]
            self._steps[slot] = steps[slot]
            reason = None
            for j, tok in enumerate(window[slot, :new]):
                lp = None
                if lps is not None and req.logprobs is not None:
                    lp = _entry(int(tok), lps[0][slot, j], lps[1][slot, j], lps[2][slot, j])
                reason = req._consume(int(tok), self.eos, lp)
                if reason is not None:
                    break
            if reason is None and done[slot]:
                reason = "length"  # done on the device without an EOS: max_out reached
            if reason is not None:
                free.append(slot)
                self._end(req, reason)
        self._release(free)

    def next_segment_steps(self) -> int:
        """Decode steps of the next segment: segment_ms / (seconds per step), in [1, segment_steps]."""
        if self.segment_ms is None:
            return self.segment_steps
        if self._step_s is None:
            return 1
        return max(1, min(self.segment_steps, int(self.segment_ms / 1e3 / self._step_s)))

    def _release(self, slots: list[int]) -> None:
        """Mark `slots` free (done) in their groups."""
        if not slots:
            return
        mask = np.zeros(self.num_slots, bool)
        mask[slots] = True
        for g, (lo, hi) in enumerate(self._spans()):
            m = mask[lo:hi]
            if m.any():
                self._groups[g] = release_slots(self._groups[g], jnp.asarray(m))
        for s in slots:
            self._slots[s] = None

    def _end(self, req: Request, reason: str, error: str | None = None) -> None:
        if req._finish(reason, error) and not req.internal:
            self.metrics.on_finish(req)

    # ---------------------------------------------------------------- metrics
    def stats(self) -> dict[str, Any]:
        """A snapshot for /metrics and tests."""
        m = self.metrics
        with m.lock:
            snap = dict(
                queue_depth=self.queue_depth,
                active_slots=self.active_slots,
                num_slots=self.num_slots,
                slot_group=self.group_size,
                decode_groups=len(self._group_rows()),
                capacity=self.capacity,
                max_context=self.max_context,
                mode=self.mode,
                slot_bytes=dict(self.slot_bytes),
                finished=dict(m.finished),
                prompt_tokens=m.prompt_tokens,
                generation_tokens=m.generation_tokens,
                decode_tokens=m.decode_tokens,
                slot_steps=m.slot_steps,
                segments=m.segments,
                greedy_segments=m.greedy_segments,
                segment_steps=m.segment_steps,
                segment_seconds=m.segment_seconds,
                prefill_seconds=m.prefill_seconds,
                mean_tokens_per_step=m.decode_tokens / max(m.slot_steps, 1),
                prefilling=int(self._job is not None),
                prefill_chunk=self.prefill_chunk,
                prefill_tokens=m.prefill_tokens,
                prefill_pieces=m.prefill_pieces,
            )
            pc = self.prefix
            snap["prefix_cache"] = dict(
                enabled=pc.enabled,
                block_tokens=pc.block_tokens,
                budget_bytes=pc.budget_bytes,
                bytes=pc.bytes,
                entries=len(pc),
                inserted=pc.inserted,
                evicted=pc.evicted,
                rejected=pc.rejected,
                checkpoints=pc.checkpoints,
                checkpointed=pc.checkpointed,
                checkpoints_dropped=pc.checkpoints_dropped,
                queries=m.prefix_queries,
                hits=m.prefix_hits,
                misses=m.prefix_queries - m.prefix_hits,
                query_tokens=m.prefix_query_tokens,
                cached_tokens=m.prefix_cached_tokens,
                hit_rate=m.prefix_hits / max(m.prefix_queries, 1),
                cached_token_fraction=m.prefix_cached_tokens / max(m.prefix_query_tokens, 1),
            )
        mem = self.memory
        snap["memory"] = dict(
            limit_bytes=mem.limit_bytes,
            usable_bytes=mem.usable_bytes,
            planned_bytes=mem.planned_bytes,
            slot_bytes=mem.slot_bytes,
            shared_step_bytes=mem.shared_bytes,
            prefix_cache_budget_bytes=mem.prefix_bytes,
        )
        snap["memory_plan"] = {
            mode: dict(
                capacity=p.capacity,
                slot_bytes=dict(p.slot_bytes),
                num_slots=p.num_slots,
                fit_slots=p.fit_slots,
            )
            for mode, p in self.plans.items()
        }
        snap["state_bytes"] = self.state_bytes
        snap["step_memory"] = dict(self.step_memory or {})
        try:
            dev = jax.devices()[0].memory_stats() or {}
        except Exception:
            dev = {}
        snap["device_bytes_in_use"] = dev.get("bytes_in_use")
        snap["device_bytes_limit"] = dev.get("bytes_limit")
        return snap


def _entry(tok: int, logp, top_ids, top_logp) -> TokenLogprob:
    return TokenLogprob(
        tok, float(logp), tuple((int(i), float(v)) for i, v in zip(top_ids, top_logp))
    )
