"""The batch-wide verification budget: one global top-K over rho, and its calibration table.

Selector (docs/algorithm.md, budget). Each request's drafter fills a candidate pool
(`drafter.Pool`, breadth ordered, rho = cumulative draft log-prob, never increasing down a
path). Instead of a fixed N-1 drafts per request, the batch verifies at most K nodes in total
(roots included): every active request keeps its root, and the K - num_active spare slots go to
the candidates with the highest rho across ALL requests, each request taking at most `cap` of
them (N-1, the static tree width). Requests with confident drafts get bigger trees. Order: by
(-rho, request, pool index), taken greedily; since rho never increases down a path and a parent
precedes its children in the pool, each request's share is a prefix of its own (-rho, pool index)
order, i.e. prefix-connected, and `tree.select_from_pool(..., num_select, n)` turns the
per-request counts back into exactly those nodes. Shapes are fixed: K is static (one compiled
program per capacity bucket).

Calibration table (format 2, docs/budget.md). Per batch bucket it holds the measured time of one
whole decode step (the engine's jitted loop) of every candidate configuration: ar; chain at a
draft depth; bole at a tree width N and a depth. Per configuration it holds an acceptance
estimate: tokens emitted per request per step, measured on the loaded model with its own MTP
head on a small built-in prompt set (random weights: the synthetic drafter's acceptance). The
engine's choice for a bucket is the configuration with the most expected tokens per second,
acceptance / step time, so where the table says the tree loses it decodes with chain or ar.
`bole_jax.measure.calibrate` measures it and stores it in the user cache, keyed by model,
device and jax version (`table_path`); here it is found and read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shlex
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp

log = logging.getLogger("bole_jax")


# ============================================================================ the selector


def select_counts(
    scores: jax.Array, active: jax.Array, budget: int, cap: jax.Array | int
) -> jax.Array:
    """Per-request draft counts of the batch-wide top-K selector (module docstring).

    scores [B, M] f32: each request's candidate pool rho (non-finite = not a candidate).
    active [B] bool: requests still decoding; inactive ones get 0 drafts and no root slot.
    budget: K, total verified nodes across the batch, roots included (static int). If fewer than
      num_active, only roots are verified.
    cap: [B] int32 or int, the most drafts request b may take (N - 1, or less for KV room).
    Returns num_select [B] int32 for `tree.select_from_pool`, with sum(num_select) <=
    max(K - num_active, 0) and num_select <= cap; greedy: the sum is as large as the pools allow.
    """
    b, m = scores.shape
    ok = active[:, None] & jnp.isfinite(scores)
    key = jnp.where(ok, -scores, jnp.inf)  # [B, M] ascending = best first
    rows = jnp.arange(b)[:, None]
    # Rank within the request by (-rho, pool index): a parent ranks before its children.
    order = jnp.argsort(key, axis=-1, stable=True)
    rank = jnp.zeros((b, m), jnp.int32).at[rows, order].set(jnp.arange(m, dtype=jnp.int32)[None])
    cap = jnp.broadcast_to(jnp.asarray(cap, jnp.int32), (b,))
    eligible = ok & (rank < cap[:, None])  # beyond the cap a request would skip them anyway
    # Global order by (-rho, request, pool index) = stable sort of the row-major flattening.
    gorder = jnp.argsort(jnp.where(eligible, key, jnp.inf).reshape(-1), stable=True)
    grank = jnp.zeros((b * m,), jnp.int32).at[gorder].set(jnp.arange(b * m, dtype=jnp.int32))
    spare = jnp.maximum(budget - jnp.sum(active.astype(jnp.int32)), 0)
    taken = eligible & (grank.reshape(b, m) < spare)  # eligible candidates occupy the first ranks
    return jnp.sum(taken, axis=-1).astype(jnp.int32)


# ============================================================================ the table
# Format 2 (docs/budget.md): per batch bucket, the measured time of one whole decode step of
# every candidate configuration (ar; chain at a depth; bole at a width N and a depth), and per
# candidate an acceptance estimate (tokens emitted per request per step). The engine's choice
# for a bucket is the candidate with the most expected tokens per second.

TABLE_FORMAT = "bole_jax.calibration/2"
OLD_FORMATS = ("bole_jax.calibration/1",)  # verify-forward timings only: no step times
CALIBRATION_FILE = "bole_calibration.json"  # looked up (never written) inside a model folder
MAX_NODES = 128  # the Pallas tree kernels verify at most 128 nodes per request
DEFAULT_VERIFY_ROWS = 256  # width of an explicit bole without a table: about this many rows
SPEC_MODES_TIMED = ("ar", "chain", "bole")
AUTO_ENV = "BOLE_JAX_AUTO_CALIBRATE"  # 1 / 0: force automatic calibration on first use on / off


@dataclasses.dataclass(frozen=True)
class BudgetChoice:
    """The decode configuration for one batch bucket: the mode and, for the speculative modes, the
    tree shape and batch budget (what `SpecConfig.for_mode` takes)."""

    num_nodes: int  # N, verified nodes per request (root included): the compiled tree width
    budget: int | None  # K, verified nodes across the batch (None: N per request)
    source: str  # where it came from (table path, "default", "cpu default", ...)
    mode: str = "bole"  # "ar" | "chain" | "bole" (pernode takes bole's shape)
    depth: int | None = None  # draft depth (None: SpecConfig's default)
    topk: int | None = None  # children per node (None: SpecConfig's default)
    tokens_per_step: float | None = None  # the acceptance estimate the choice was made with
    step_ms: float | None = None  # the measured step time

    def spec_options(self) -> dict:
        """SpecConfig options of this choice (empty for ar)."""
        if self.mode == "ar":
            return {}
        opts = dict(num_nodes=self.num_nodes, budget=self.budget)
        opts.update(
            {k: v for k, v in (("depth", self.depth), ("topk", self.topk)) if v is not None}
        )
        return opts

    @property
    def tokens_per_ms(self) -> float | None:
        if self.tokens_per_step is None or not self.step_ms:
            return None
        return self.tokens_per_step / self.step_ms


# Fields that do not change the cost of a forward (the MTP head's size is part of the model
# identity instead: it changes the draft stage's cost and the acceptance), and the kernel
# options: a table is timed with the options of the run that made it.
_NOT_SPEED = (
    "eos_token_ids",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "norm_topk_prob",
    "dtype",
    "mtp_num_layers",
    "kernels",
)


def model_signature(cfg, param_dtype) -> dict:
    """The model dims a calibration table is valid for (JSON-normalised): every config field that
    changes the cost of a forward, plus the dtype the weights are held in."""
    d = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_SPEED}
    d["param_dtype"] = str(jnp.dtype(param_dtype))
    return json.loads(json.dumps(d))


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_identity(
    cfg,
    param_dtype,
    model_dir: str | os.PathLike | None = None,
    *,
    draft_vocab: int | None = None,
    drafter: str = "mtp",
) -> dict:
    """What identifies the model a table was measured on (JSON-ready).

    model_dir: the checkpoint folder: config.json's bytes and every weight file's name, size and
      mtime (a re-downloaded or retrained checkpoint is another model), hashed. None: random
      weights, identified by their dims alone.
    draft_vocab: tokens the MTP drafter scores (None: the whole vocabulary).
    drafter: "mtp" (the checkpoint's head) or "synthetic p=..." (random weights: acceptance is
      the synthetic drafter's, not measured)."""
    ident = dict(
        signature=_sha(model_signature(cfg, param_dtype)),
        drafter=drafter,
        draft_vocab=draft_vocab,
        mtp_layers=int(cfg.mtp_num_layers or 0),
    )
    if model_dir is not None:
        d = Path(model_dir)
        files = (
            sorted(
                p
                for p in d.iterdir()
                if p.suffix == ".safetensors" or p.name.endswith(".safetensors.index.json")
            )
            if d.is_dir()
            else []
        )
        conf = d / "config.json"
        ident.update(
            name=d.resolve().name,
            config=hashlib.sha256(conf.read_bytes()).hexdigest()[:16] if conf.is_file() else None,
            weights=_sha([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]),
        )
    else:
        ident["name"] = f"{cfg.family}-random"
    return ident


def table_key(identity: dict, device: str | None = None, jax_version: str | None = None) -> str:
    """The cache key of a table: the model identity, the device and the jax version, hashed."""
    return _sha(
        dict(model=identity, device=device or device_name(), jax=jax_version or jax.__version__)
    )


def device_name() -> str:
    return jax.devices()[0].device_kind


def default_table_dir() -> Path:
    """The user cache folder of calibration tables: `$BOLE_JAX_CACHE/calibration`, else
    `$XDG_CACHE_HOME/bole_jax/calibration`, else `~/.cache/bole_jax/calibration`."""
    root = os.environ.get("BOLE_JAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "bole_jax"
    )
    return Path(root) / "calibration"


def table_path(identity: dict, device: str | None = None, jax_version: str | None = None) -> Path:
    """Where the table of this model on this device and jax version lives in the user cache."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in identity.get("name", "model"))
    return default_table_dir() / f"{name}-{table_key(identity, device, jax_version)}.json"


def _package_dir() -> Path:
    return Path(__file__).resolve().parent.parent


def check_writable_location(path: str | os.PathLike) -> Path:
    """`path` unless it lies inside the installed package (tables belong in the user cache)."""
    p = Path(path).resolve()
    if p == _package_dir() or _package_dir() in p.parents:
        raise ValueError(
            f"{path} is inside the installed bole_jax package: calibration tables go "
            f"to the user cache ({default_table_dir()}, set BOLE_JAX_CACHE to move it) "
            "or to an --out path outside the package"
        )
    return Path(path)


def load_table(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"calibration table not found: {path} (make one with `bole-jax calibrate`)"
        )
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a calibration table (invalid JSON: {e.msg})") from None
    fmt = table.get("format") if isinstance(table, dict) else None
    if fmt in OLD_FORMATS:
        raise ValueError(
            f"{path}: a calibration table of the old format {fmt!r} (verify times "
            "only, no step times or acceptance): run `bole-jax calibrate` again"
        )
    if fmt != TABLE_FORMAT or not table.get("entries"):
        raise ValueError(f"{path}: not a calibration table (expected format {TABLE_FORMAT!r})")
    return table


def table_mismatch(table: dict, cfg, param_dtype, device: str | None = None) -> str | None:
    """Why `table` does not apply to this model's dims on this device (None when it does)."""
    device = device or device_name()
    if table.get("device") != device:
        return f"calibrated on {table.get('device')!r}, running on {device!r}"
    sig = model_signature(cfg, param_dtype)
    model = {"tp": 1, **table.get("model", {})}
    diff = sorted(k for k in set(sig) | set(model) if sig.get(k) != model.get(k))
    if diff:
        return f"model dims differ ({', '.join(diff[:4])})"
    return None


def find_table(
    cfg,
    param_dtype,
    *,
    path: str | os.PathLike | None = None,
    model_dir: str | os.PathLike | None = None,
    identity: dict | None = None,
) -> tuple[dict | None, str]:
    """The calibration table for this model and device.

    Searched: `path` if given (must exist; must match the device and model dims); else the user
    cache entry keyed by (identity, device, jax version) (`table_path`; identity defaults to
    `model_identity(cfg, param_dtype, model_dir)`); else `<model_dir>/bole_calibration.json` (a
    table shipped with a checkpoint, checked against the device and dims). Returns (table or None,
    where it came from or why none matched)."""
    if path is not None:
        table = load_table(path)
        why = table_mismatch(table, cfg, param_dtype)
        return (table, str(path)) if why is None else (None, f"{path}: {why}")
    identity = identity or model_identity(cfg, param_dtype, model_dir)
    reasons = []
    cached = table_path(identity)
    candidates = [cached] + ([Path(model_dir) / CALIBRATION_FILE] if model_dir is not None else [])
    for c in candidates:
        if not c.is_file():
            continue
        try:
            table = load_table(c)
        except ValueError as e:
            reasons.append(str(e))
            continue
        why = table_mismatch(table, cfg, param_dtype)
        if why is None:
            return table, str(c)
        reasons.append(f"{c}: {why}")
    return None, "; ".join(reasons) or f"no table at {cached}"


def _bucket(values: Sequence[int], x: int | None) -> int:
    """Smallest bucket >= x (the largest if none; the largest when x is None)."""
    values = sorted(values)
    if x is None:
        return values[-1]
    return next((v for v in values if v >= x), values[-1])


def candidate_id(c: dict) -> str:
    """The configuration a candidate names: 'ar', 'chain d=8', 'bole N=16 d=8 k=4'."""
    if c["mode"] == "ar":
        return "ar"
    if c["mode"] == "chain":
        return f"chain d={c['depth']}"
    return f"{c['mode']} N={c['nodes']} d={c['depth']} k={c['topk']}"


def acceptance_of(table: dict, c: dict) -> float | None:
    """Tokens emitted per request per step of candidate `c`: the table's acceptance estimate for
    its configuration (pooled over the batch buckets), else the candidate's own measurement."""
    if c["mode"] == "ar":
        return 1.0
    a = table.get("acceptance", {}).get(candidate_id(c))
    if a is not None:
        return float(a["tokens_per_step"] if isinstance(a, dict) else a)
    return c.get("tokens_per_step")


def rank_candidates(table: dict, entry: dict, modes: Sequence[str] | None = None) -> list[dict]:
    """The entry's timed candidates (of `modes`, default all) with their expected throughput
    `tokens_per_ms` = acceptance / step_ms, best first (ties: fewer verified rows, i.e. ar before
    chain before bole, then the smaller tree)."""
    out = []
    for c in entry["candidates"]:
        if modes is not None and c["mode"] not in modes:
            continue
        acc = acceptance_of(table, c)
        if c.get("step_ms") is None or acc is None or not c["step_ms"] > 0:
            continue  # not timed (early stop, time budget, out of memory)
        out.append({**c, "tokens_per_step": acc, "tokens_per_ms": acc / c["step_ms"]})
    order = {"ar": 0, "chain": 1}
    out.sort(key=lambda c: (-c["tokens_per_ms"], order.get(c["mode"], 2), c["nodes"]))
    return out


def choose(
    table: dict,
    batch: int,
    kv: int | None = None,
    source: str = "table",
    mode: str | None = None,
    topk: int | None = None,
) -> BudgetChoice | None:
    """The table's choice for a batch of `batch` requests (bucket: the smallest >= batch, else the
    largest): the timed candidate with the most expected tokens per second, among all modes
    (mode None) or of one mode (an explicit spec: "bole" / "pernode" take the best bole tree,
    "chain" the best chain depth). None when the table timed no candidate of that mode there.
    kv: the KV capacity the requests decode at: the smallest KV bucket >= kv (else the largest),
      among every entry of the batch bucket, those timed over filled long contexts (`context`,
      `calibrate(contexts=...)`) included. None: the entries timed at the calibration's own short
      context only (the largest of them).
    topk: only bole candidates with this many children per node (the bole chain has 1); mode
    "pernode" without topk takes the best tree (more than one child per node)."""
    b = _bucket(sorted({e["batch"] for e in table["entries"]}), batch)
    at_b = [e for e in table["entries"] if e["batch"] == b]
    if kv is None:  # the calibration's own context (tables before `contexts` have nothing else)
        at_b = [e for e in at_b if not e.get("context")] or at_b
    s = _bucket(sorted({e["kv"] for e in at_b}), kv)
    e = next(e for e in at_b if e["kv"] == s)
    want = None if mode is None else ("bole",) if mode in ("bole", "pernode") else (mode,)
    ranked = rank_candidates(table, e, want)
    if topk is not None:
        ranked = [c for c in ranked if c["mode"] != "bole" or int(c["topk"]) == topk]
    elif mode == "pernode":  # the per-node tree baseline: a tree, never the bole chain's shape
        ranked = [c for c in ranked if int(c["topk"]) > 1]
    if not ranked:
        return None
    c = ranked[0]
    spec = c["mode"] != "ar"
    return BudgetChoice(
        num_nodes=int(c["nodes"]),
        budget=batch_bucket(batch) * int(c["nodes"]) if spec else None,
        source=source,
        mode=c["mode"] if mode is None else mode,
        depth=int(c["depth"]) if spec else None,
        topk=int(c["topk"]) if spec else None,
        tokens_per_step=c["tokens_per_step"],
        step_ms=c["step_ms"],
    )


def batch_bucket(batch: int) -> int:
    """The engine's batch bucket (the compiled batch): the next power of two."""
    return 1 << (max(batch, 1) - 1).bit_length()


def default_choice(batch: int) -> BudgetChoice:
    """An explicit bole without a table: about DEFAULT_VERIFY_ROWS verify rows per step
    (power-of-two width in [4, 64]), budget = batch bucket * width. Correct anywhere; fast only
    by luck (docs/budget.md)."""
    b = batch_bucket(batch)
    n = 1 << int(math.log2(max(DEFAULT_VERIFY_ROWS // b, 1)))
    n = min(max(n, 4), 64)
    return BudgetChoice(num_nodes=n, budget=b * n, source="default")


def untabled_mode() -> str:
    """The mode the engine decodes with when no table applies: ar, on every platform.

    Why (docs/budget.md): whether a tree or a chain wins depends on the model's acceptance and
    the step times, which only a measurement knows. Without one, speculation has lost to AR in
    measured configurations: on CPU the bole default decoded the demo model at 27 tok/s against
    AR's 165 (B = 1), and on an H200 the default tree ran the demo model at 0.69x AR at B = 64;
    a chain's step cost ~2.2x an AR step there, so it loses wherever the head accepts fewer than
    ~2.2 tokens per step. AR is the only configuration that never loses to AR. On an
    accelerator the engine measures first (automatic calibration) and only then speculates."""
    return "ar"


_warned: set = set()


def _warn_once(key, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)


# A notice where a batch decodes at this many times the largest KV capacity its table timed.
BEYOND_CONTEXT_FACTOR = 8


def _warn_beyond_contexts(table: dict, batch: int, kv: int | None, where: str, command: str):
    """Once per table, batch bucket and KV capacity: the table chose for a context far longer
    than any it timed (docs/budget.md, "Long contexts": at 16k tokens per request AR can beat
    the tree the short context chose), with the command that times it."""
    if kv is None:
        return
    b = _bucket(sorted({e["batch"] for e in table["entries"]}), batch)
    longest = max(e["kv"] for e in table["entries"] if e["batch"] == b)
    if kv < BEYOND_CONTEXT_FACTOR * longest:
        return
    want = 1 << (kv - 1).bit_length()
    how = (  # the API form for in-memory weights, the CLI flag otherwise
        f"{command[: -len('()')]}(contexts=[{want}])"
        if command.endswith("calibrate()")
        else f"{command} --context {want}"
    )
    _warn_once(
        ("context", where, b, want),
        f"bole_jax: the calibration table ({where}) timed batch {b} at KV capacities up to "
        f"{longest} tokens, and this batch decodes at {kv}: at long contexts the drafter's and the "
        f"verify's attention read the whole cache, and the fastest mode can be ar. Time it "
        f"with `{how}`.",
    )


def calibrate_command(
    model_dir: str | os.PathLike | None, *, embedded: bool = False, preset: str | None = None
) -> str:
    """The command that calibrates this model: `bole-jax calibrate` for the embedded demo,
    `bole-jax calibrate --model DIR` for a checkpoint folder, `--preset NAME` for random dims."""
    if embedded:
        return "bole-jax calibrate"
    if model_dir is not None:
        return f"bole-jax calibrate --model {shlex.quote(str(Path(model_dir).resolve()))}"
    if preset is not None:
        return f"bole-jax calibrate --preset {preset}"
    return "LLM(...).calibrate()"  # random weights: no folder to name


def notice(command: str, where: str, *, mode: str, width: BudgetChoice | None = None) -> str:
    """The message printed once when no table applies."""
    what = (
        f"decoding with {mode}"
        if width is None
        else f"decoding {mode} at the default tree width {width.num_nodes}"
    )
    return (
        f"bole_jax: no calibration table for this model on {device_name()} ({where}); "
        f"{what}. Measure the fastest mode for it with `{command}`."
    )


def choice_for(
    cfg,
    param_dtype,
    batch: int,
    *,
    calibration: str | os.PathLike | None = None,
    model_dir: str | os.PathLike | None = None,
    kv: int | None = None,
    mode: str | None = "bole",
    identity: dict | None = None,
    command: str | None = None,
    topk: int | None = None,
    quiet: bool = False,
) -> BudgetChoice:
    """The decode configuration for `batch` requests from the matching table (see `find_table`):
    mode None = the best of every mode; a mode name = that mode's best shape (topk: of bole
    trees with that many children per node only). Without a table (or
    a table that timed no candidate of `mode`): mode None -> `untabled_mode()`; an explicit mode
    keeps it at `default_choice`'s width; one notice per model and device, naming `command` (none
    with `quiet`: a configuration looked up for comparison, not decoded with)."""
    table, where = find_table(
        cfg, param_dtype, path=calibration, model_dir=model_dir, identity=identity
    )
    if table is not None:
        c = choose(table, batch, kv, source=where, mode=mode, topk=topk)
        if c is not None:
            if not quiet:
                _warn_beyond_contexts(
                    table, batch, kv, where, command or calibrate_command(model_dir)
                )
            return c
        what = "configuration" if mode is None else f"{mode} configuration"
        where = f"{where} timed no {what} at batch {batch}" + ("" if kv is None else f", KV {kv}")
    if mode is None:
        m = untabled_mode()
        d = BudgetChoice(num_nodes=1, budget=None, source="default", mode=m)
    else:
        d = dataclasses.replace(default_choice(batch), mode=mode)
    if quiet:
        return d
    _warn_once(
        (device_name(), _sha(identity or model_signature(cfg, param_dtype)), mode is None),
        notice(
            command or calibrate_command(model_dir),
            where,
            mode=d.mode,
            width=None if d.mode in ("ar", "chain") else d,  # a chain has no tree width
        ),
    )
    return d


def resolve_spec_options(
    cfg,
    spec_options: dict | None,
    *,
    param_dtype,
    batch: int,
    model_dir: str | os.PathLike | None = None,
    mode: str = "bole",
    identity: dict | None = None,
    command: str | None = None,
    quiet: bool = False,
    kv: int | None = None,
) -> dict:
    """`LLM(spec_options=...)` for `mode` with the calibrated tree shape filled in.

    Explicit `num_nodes` or `budget` win (the table is not consulted); `calibration` (a table
    path) and `auto_calibrate` are consumed here. Otherwise the table matching (model, device)
    chooses the width, budget and depth for `mode` at a batch of `batch` requests decoding at a
    KV capacity of `kv` (`choose`; None: the calibration's own context), explicit `depth` /
    `topk` winning over the table's."""
    opts = dict(spec_options or {})
    path = opts.pop("calibration", None)
    opts.pop("auto_calibrate", None)
    if "num_nodes" in opts or "budget" in opts:
        return opts
    c = choice_for(
        cfg,
        param_dtype,
        batch,
        calibration=path,
        model_dir=model_dir,
        kv=kv,
        mode=mode,
        identity=identity,
        command=command,
        quiet=quiet,
    )
    if c.mode == "chain":  # chain's width is depth + 1 (SpecConfig.for_mode)
        return {**{k: v for k, v in c.spec_options().items() if k == "depth"}, **opts}
    return {**c.spec_options(), **opts}


# ============================================================================ the engine's view


def llm_identity(llm) -> dict:
    """`model_identity` of an `LLM` (duck-typed: cfg, params, path, spec_options)."""
    from bole_jax.spec_decode import draft_vocab as dv

    dtype = llm.params["embed"].dtype
    nv = int(llm.params["mtp"]["draft_ids"].shape[0]) if dv.has_draft_vocab(llm.params) else None
    p = table_accept_prob(llm.spec_options)
    return model_identity(
        llm.cfg,
        dtype,
        llm.path,
        draft_vocab=nv,
        drafter="mtp" if p is None else f"synthetic p={p:.4f}",
    )


def simulated_accept_prob(spec_options: dict | None) -> float | None:
    """p of `LLM(spec_options=...)`'s simulated acceptance (SpecConfig.simulate_accept), at the
    options' depth (default 8) for simulate_accept_mean; None without one. Tables and first-use
    calibration treat it as the synthetic drafter's p: the same acceptance, the same choice."""
    opts = spec_options or {}
    if opts.get("simulate_accept") is not None:
        return float(opts["simulate_accept"])
    if opts.get("simulate_accept_mean") is None:
        return None
    from bole_jax.spec_decode.acceptance import synthetic_accept_prob
    from bole_jax.spec_decode.drafter import TreeShape

    return synthetic_accept_prob(opts["simulate_accept_mean"], opts.get("depth", TreeShape().depth))


def table_accept_prob(spec_options: dict | None) -> float | None:
    """The acceptance probability calibration tables of these `LLM(spec_options=...)` are
    measured and keyed at: the synthetic drafter's p, else the simulated acceptance's p, else
    None (the model's own drafter)."""
    p = (spec_options or {}).get("synthetic_accept")
    return simulated_accept_prob(spec_options) if p is None else p


def is_embedded_model(path) -> bool:
    """Whether `path` is the demo model embedded in the package (bole_jax/default_model)."""
    return path is not None and Path(path).resolve() == (_package_dir() / "default_model").resolve()


def llm_command(llm) -> str:
    """The calibrate command for this LLM's model (`calibrate_command`)."""
    path = getattr(llm, "path", None)
    return calibrate_command(path, embedded=is_embedded_model(path))


def spec_options_for(
    llm, mode: str, batch: int, quiet: bool = False, kv: int | None = None
) -> dict:
    """The SpecConfig options `llm` decodes `mode` with at a batch of `batch` requests and a KV
    capacity of `kv` (None: the calibration's own context; `quiet`: without the no-table
    notice)."""
    return resolve_spec_options(
        llm.cfg,
        llm.spec_options,
        param_dtype=llm.params["embed"].dtype,
        batch=batch,
        model_dir=llm.path,
        mode=mode,
        identity=llm_identity(llm),
        command=llm_command(llm),
        quiet=quiet,
        kv=kv,
    )
