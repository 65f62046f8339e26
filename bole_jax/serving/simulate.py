"""Serving for benchmarks: random weights at a preset's dimensions and simulated acceptance.

`bole-jax serve --preset NAME` serves random weights with the dimensions of a published model
(`model.presets`, the offline benchmarks' path: `parallel.init_params` + `presets.peaked_lm_head`)
behind the embedded demo model's tokenizer (`SimulatedTokenizer`). `--simulate-accept-mean X`
(with a preset or a checkpoint) replaces the speculative modes' acceptance by a simulated one with
X tokens per step on average (SpecConfig.simulate_accept, `acceptance.accept_simulated`), as
SGLang's SGLANG_SIMULATE_ACC_LEN: the step costs what a real step of that acceptance costs, but
what it emits is not the model's output. Either way the server says so (`describe`: /v1/models
"simulated", /health) and warns at start-up.
"""

from __future__ import annotations

import logging
from typing import Sequence

log = logging.getLogger("bole_jax.serving")

# Text of a generated token id the tokenizer does not know (a random-weight model's vocabulary can
# be larger than the demo tokenizer's). Not U+FFFD, which the incremental detokeniser holds back as
# the start of an unfinished UTF-8 character.
UNKNOWN_TOKEN_TEXT = "\u25a1"


class SimulatedTokenizer:
    """A tokenizer (`llm.Tokenizer`) in front of a model of `vocab_size` tokens it was not made for.

    encode: ids of a larger tokenizer are folded into the model's vocabulary (id % vocab_size), so
    that every prompt is valid; decode: ids the tokenizer does not know become UNKNOWN_TOKEN_TEXT
    (one per token) instead of vanishing or raising."""

    def __init__(self, tokenizer, vocab_size: int, folder=None):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.known = int(tokenizer._tok.get_vocab_size())
        self.folder = folder  # where its tokenizer.json (and chat template) came from

    def _fold(self, i: int) -> int:
        return i % self.vocab_size if self.known > self.vocab_size else i

    def encode(self, text: str) -> list[int]:
        return [self._fold(i) for i in self.tokenizer.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        parts, run = [], []
        for i in ids:
            i = int(i)
            if 0 <= i < self.known:
                run.append(i)
                continue
            if run:
                parts.append(self.tokenizer.decode(run))
                run = []
            parts.append(UNKNOWN_TOKEN_TEXT)
        if run:
            parts.append(self.tokenizer.decode(run))
        return "".join(parts)

    def token_to_id(self, tok: str) -> int | None:
        i = self.tokenizer.token_to_id(tok)
        return None if i is None else self._fold(int(i))


def preset_llm(
    name: str,
    *,
    dtype: str | None = None,
    tp: int = 1,
    spec_options: dict | None = None,
    draft_vocab: int | None = None,
    seed: int = 0,
):
    """An `LLM` of random weights with preset `name`'s dimensions and an MTP head, with the
    embedded demo model's tokenizer (`SimulatedTokenizer`). dtype default: bfloat16, float32 on
    CPU. `llm.preset` holds the name."""
    import jax

    from bole_jax.llm import DEFAULT_MODEL_DIR, LLM, Tokenizer
    from bole_jax.model import parallel
    from bole_jax.model.presets import peaked_lm_head, preset

    dtype = dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    cfg = preset(name, mtp=True, dtype=dtype, tp=parallel.check_tp(tp))
    params = peaked_lm_head(parallel.init_params(cfg, jax.random.key(seed), dtype), cfg)
    llm = LLM(cfg, params=params, spec_options=spec_options, draft_vocab=draft_vocab)
    llm.tokenizer = SimulatedTokenizer(
        Tokenizer(DEFAULT_MODEL_DIR / "tokenizer.json"), cfg.vocab_size, DEFAULT_MODEL_DIR
    )
    llm.preset = name
    return llm


def describe(scheduler) -> dict | None:
    """What the server's outputs simulate (/v1/models "simulated"), None for a real model's."""
    from bole_jax.spec_decode.acceptance import expected_tokens_per_step

    preset = getattr(scheduler.llm, "preset", None)
    spec = scheduler.spec
    p = spec.simulate_accept if spec is not None else None
    if preset is None and p is None:
        return None
    return {
        "weights": f"random, preset {preset}" if preset is not None else "checkpoint",
        "acceptance": None
        if p is None
        else {
            "accept_prob": p,
            "depth": spec.shape.depth,
            "mean_tokens_per_step": expected_tokens_per_step(p, spec.shape.depth),
        },
        "note": "benchmark server: outputs are simulated, not a model's"
        if p is not None
        else "benchmark server: random weights, outputs are not a model's",
    }


def startup_warning(info: dict | None) -> bool:
    """Log a loud warning when the server's outputs are simulated (`describe`). True if it did."""
    if info is None:
        return False
    acc = info["acceptance"]
    log.warning("=" * 72)
    log.warning("SIMULATED OUTPUTS (benchmarks only): %s", info["note"])
    log.warning("weights: %s", info["weights"])
    if acc is not None:
        log.warning(
            "simulated acceptance: p = %.4f per depth over depth %d, %.2f tokens per step on "
            "average; the emitted tokens are the drafter's, not the target model's",
            acc["accept_prob"],
            acc["depth"],
            acc["mean_tokens_per_step"],
        )
    log.warning("=" * 72)
    return True
