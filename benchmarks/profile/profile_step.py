"""Where a decode step's time goes: the device kernels of one jitted program, from a trace.

    python benchmarks/profile/profile_step.py --out benchmarks/results/profile_qwen3.5-9b_h200.json
    python benchmarks/profile/profile_step.py --programs ar step --reps 20 --trace-dir /tmp/prof
    python benchmarks/profile/profile_step.py --preset tiny --batch 2 --nodes 4 --depth 3 --topk 2 \\
        --accept-mean 2.5 --draft-vocab 0 --reps 3 --out /tmp/profile_tiny.json     # CPU

The model, prompts, prefill and synthetic-acceptance drafter are the ones of `bole-jax bench`
(bole_jax/measure/bench.py: random weights of a preset, the drafter's oracle from an AR run of the same
prompts). Every program is compiled ahead of time, warmed up, then `--reps` repetitions run
inside `jax.profiler.trace`, and the trace is read back:

  ar      the engine's AR loop (`LLM.segment_fn("ar")`): one call of --reps steps
  step    the engine's spec loop of --mode (`LLM.segment_fn("bole")` by default; pernode /
          chain: the baselines' loop): one call of --reps spec steps
  draft select verify accept commit emit
          the stages of one spec step (`bench.stage_functions`, as the bench's step breakdown
          times them), each called --reps times on the inputs `bench.stage_inputs` makes for
          the first spec step (shapes are static: a later step runs the same kernels). A
          donated cache is a fresh copy per call, made by another program: its kernels are
          left out, as are those of every module other than the profiled one.

Per program: wall ms per repetition (host clock; the median call for a stage), device busy ms
(the sum of kernel times) and active ms (their union; wall - active is time the device waited:
launches, host syncs), and the kernel time by kernel name, by HLO op (with the line of Python
source it was traced from, read off the compiled HLO's metadata), by category and by source
line. Prints the tables; writes JSON to --out.

In-loop stage split (programs ar and step): spec_step runs each stage under a named scope
("stage_draft" ... "stage_emit", loop.ar_step "stage_ar"), which the compiled HLO keeps in each
op's metadata op_name; the loop's kernel time is summed by the stage of its op (a GPU command
buffer takes the stage of the ops it calls, "mixed(...)" when they span stages), with an
"other" row (the loop's own ops, XLA copies) and an "idle" row (wall - active), per loop step:
the split of the step as the engine runs it, not of stages compiled alone. Beside each stage
its bytes floor (bench.stage_floor_bytes, bench.ar_step_floor_bytes) and, on a device of known
bandwidth (bench.PEAK_GBPS), the floor's time and the ratio to it. XLA may fuse ops of two
stages into one kernel: a fusion counts for the stage of its root op.

Trace formats: the run's *.xplane.pb through `jax.profiler.ProfileData` (from_file, else
from_serialized_xspace), else its *.trace.json.gz (--trace-reader forces one). Device time is
the events on the stream lines of the "/device:..." planes (the derived lines "XLA Ops",
"XLA Modules", ... repeat them and are left out). A trace without a device plane (CPU) falls
back on the host thunk events that carry an hlo_op: control-flow thunks (while, conditional,
call) are left out, their bodies are counted, and time nested on one thread is counted once;
independent thunks run on several threads at once, so busy can exceed wall there.

GPU: XLA runs most kernels inside command buffers (CUDA graphs) by default, where the kernels
lose their HLO op in the trace; their op is then recovered from the kernel name where XLA named
the kernel after it (fusions), else shown as the command buffer's. --no-command-buffer profiles
every kernel on its own (exact attribution, but different launch gaps: compare the wall times).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import dataclasses
import glob
import gzip
import itertools
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bole_jax import compile_cache  # noqa: E402
from bole_jax.measure import bench  # noqa: E402
from bole_jax.measure.env import environment, progress_bar  # noqa: E402
from bole_jax.model import parallel  # noqa: E402

STAGES = bench.STAGES  # draft select verify accept commit emit
PROGRAMS = ("ar", *STAGES, "step")
DEFAULT_PROGRAMS = ("ar", "draft", "verify", "commit", "step")

# Lines of a device plane derived from the stream lines (tsl xplane_schema): not kernels.
DERIVED_LINES = frozenset(
    {
        "XLA Modules",
        "XLA Ops",
        "Async XLA Ops",
        "Steps",
        "Framework Ops",
        "Framework Name Scope",
        "Source code",
        "Launch Stats",
        "Host Offload Ops",
        "_counters_",
        "Sparse Core Steps",
        "Sparse Core Modules",
        "XLA TraceMe",
    }
)
# HLO ops whose thunk contains other thunks (host traces nest their bodies' events in them).
CONTAINER_OPCODES = frozenset({"while", "conditional", "call"})

# (category, pattern): the first pattern found in "kernel hlo_op opcode custom-call-target"
# (lower case) wins; when none is, the same search runs on the leaf of the op's jax op_name.
CATEGORIES = (
    ("tree kernels (pallas)", r"bole_|tree_pernode|chain_verify"),
    (
        "collective",
        r"nccl|all-reduce|all_reduce|allreduce|all-gather|all_gather|"
        r"reduce-scatter|reduce_scatter|all-to-all|collective",
    ),
    ("memcpy / memset", r"memcpy|memset"),
    ("matmul", r"gemm|gemv|cublas|cutlass|nvjet|xmma|matmul|\bdot\b|dot_general|convolution"),
    ("pallas / triton (other)", r"pallas|triton|mosaic"),
    ("attention (cudnn / flash)", r"cudnn|flash|fmha|attention"),
    ("sort / top-k", r"sort|top_?k|top-k|radix"),
    ("gather / scatter / slice", r"gather|scatter|dynamic.update.slice|dynamic.slice"),
    ("reduction", r"reduce|reduction"),
    ("copy / transpose", r"copy|transpose"),
)


# ============================================================================ trace files


@dataclasses.dataclass
class Event:
    """One timed event of a trace: plane ("/device:GPU:0", "/host:CPU"), line (a GPU stream, a
    host thread), name (kernel or thunk), start and duration in ns, stats (hlo_op, hlo_module,
    ...)."""

    plane: str
    line: str
    name: str
    start_ns: float
    dur_ns: float
    stats: dict

    @property
    def end_ns(self) -> float:
        return self.start_ns + self.dur_ns


def _is_device(plane: str) -> bool:
    return plane.startswith("/device:")


def _wanted(plane: str) -> bool:
    return _is_device(plane) or plane == "/host:CPU"


_ANNOTATION = re.compile(r"\b(hlo_op|hlo_module)=([^,#\s]+)")


def _stats(stats: dict) -> dict:
    """An event's stats, with hlo_op / hlo_module read out of an XLA annotation string
    ("fusion.3:#hlo_op=fusion.3,hlo_module=jit_f,program_id=7#") when only that is there."""
    if "hlo_op" not in stats:
        for v in stats.values():
            if isinstance(v, str) and "hlo_op=" in v:
                return {**dict(_ANNOTATION.findall(v)), **stats}
    return stats


def trace_run_dir(log_dir: str) -> str:
    """The newest <log_dir>/plugins/profile/<run>/ folder jax.profiler.trace wrote."""
    runs = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", ""))
    if not runs:
        raise FileNotFoundError(
            f"no profiler run under {log_dir}/plugins/profile/ (did the trace "
            "start? jax.profiler.trace writes one folder per run there)"
        )
    return max(runs, key=os.path.getmtime)


def read_xplane(path: str) -> tuple[str, list[Event]]:
    """Events of an .xplane.pb through jax.profiler.ProfileData (from_file, then
    from_serialized_xspace). Returns (the API that read it, events)."""
    data_cls = getattr(jax.profiler, "ProfileData", None)
    if data_cls is None:
        raise RuntimeError(f"jax {jax.__version__} has no jax.profiler.ProfileData")

    def from_bytes():
        with open(path, "rb") as f:
            return data_cls.from_serialized_xspace(f.read())

    loaders = [
        ("ProfileData.from_file", lambda: data_cls.from_file(path)),
        ("ProfileData.from_serialized_xspace", from_bytes),
    ]
    errors = []
    for api, load in loaders:
        if not hasattr(data_cls, api.split(".")[1]):
            errors.append(f"{api}: not in jax {jax.__version__}")
            continue
        try:
            data = load()
        except Exception as e:  # noqa: BLE001 - the next API may read it
            errors.append(f"{api}: {type(e).__name__}: {e}")
            continue
        events = [
            Event(
                plane.name,
                line.name,
                ev.name,
                float(ev.start_ns),
                float(ev.duration_ns),
                _stats(dict(ev.stats)),
            )
            for plane in data.planes
            if _wanted(plane.name)
            for line in plane.lines
            for ev in line.events
        ]
        return api, events
    raise RuntimeError("; ".join(errors))


def read_trace_json(path: str) -> tuple[str, list[Event]]:
    """Events of a Chrome-trace *.trace.json.gz (ts and dur in us; process = plane, thread =
    line, args = stats)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    evs = trace.get("traceEvents", [])
    meta = [e for e in evs if e.get("ph") == "M"]
    planes = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    lines = {
        (e["pid"], e.get("tid")): e["args"]["name"] for e in meta if e.get("name") == "thread_name"
    }
    events = [
        Event(
            planes.get(e.get("pid"), ""),
            lines.get((e.get("pid"), e.get("tid")), ""),
            e.get("name", ""),
            1e3 * float(e["ts"]),
            1e3 * float(e.get("dur", 0.0)),
            _stats(e.get("args", {})),
        )
        for e in evs
        if e.get("ph") == "X" and _wanted(planes.get(e.get("pid"), ""))
    ]
    return "trace.json.gz", events


def read_trace(log_dir: str, reader: str = "auto") -> tuple[dict, list[Event]]:
    """The events of the newest run under `log_dir`: the xplane.pb first, then the
    trace.json.gz (reader "auto"), or only the one `reader` names ("xplane" | "json"). Returns
    ({reader, file}, events); raises naming every attempt when none could be read."""
    run = trace_run_dir(log_dir)
    files = dict(
        xplane=sorted(glob.glob(os.path.join(run, "*.xplane.pb"))),
        json=sorted(glob.glob(os.path.join(run, "*.trace.json.gz"))),
    )
    readers = dict(xplane=read_xplane, json=read_trace_json)
    errors = []
    for kind in ("xplane", "json") if reader == "auto" else (reader,):
        if not files[kind]:
            errors.append(f"{kind}: no *.{'xplane.pb' if kind == 'xplane' else 'trace.json.gz'}")
            continue
        if len(files[kind]) > 1:  # one host: one file; more would be another process's
            print(
                f"[profile] {len(files[kind])} {kind} files in {run}: reading "
                f"{os.path.basename(files[kind][0])}",
                file=sys.stderr,
            )
        try:
            api, events = readers[kind](files[kind][0])
        except Exception as e:  # noqa: BLE001 - try the other format
            errors.append(f"{kind} ({os.path.basename(files[kind][0])}): {e}")
            continue
        return dict(reader=api, file=os.path.relpath(files[kind][0], log_dir)), events
    raise RuntimeError(
        f"could not read the trace in {run}: "
        + " | ".join(errors)
        + " (keep it with --trace-dir and open it in xprof or Perfetto)"
    )


# ============================================================================ HLO metadata


@dataclasses.dataclass
class HloOp:
    """An instruction of the compiled HLO: opcode, custom-call target ("" if none), the leaf of
    its jax op_name ("dot_general"), and where in the Python source it was traced
    ("model/layers.py:100 attend"; "" when the metadata has none)."""

    opcode: str
    target: str
    op_leaf: str
    source: str
    stage: str = ""  # the step stage its op_name names (`stage_of`), "" if none


STAGE_RE = re.compile(r"(?:^|/)stage_([A-Za-z0-9]+)(?:/|$)")


def stage_of(op_name: str) -> str:
    """The stage of an op from its jax op_name: the outermost "stage_<name>" named scope
    (spec_decode/step.py's stages, "ar" for loop.ar_step), "" where there is none."""
    m = STAGE_RE.search(op_name)
    return m.group(1) if m else ""


def _numbered_section(text: str, name: str) -> dict[int, str]:
    """An `id value` table of an HLO module's text (FileNames, FunctionNames, FileLocations,
    StackFrames: where newer XLA keeps the source locations that metadata refers to)."""
    m = re.search(rf"^{name}\n((?:\d+ .*\n?)*)", text, re.M)
    if not m:
        return {}
    rows = (line.split(" ", 1) for line in m.group(1).splitlines())
    return {int(k): v.strip() for k, v in rows}


def _short_path(path: str) -> str:
    path = path.strip('"')
    return path.rsplit("bole_jax/", 1)[1] if "bole_jax/" in path else os.path.basename(path)


def parse_hlo(text: str) -> tuple[str, dict[str, HloOp]]:
    """(module name, {instruction name: HloOp}) of a compiled program's HLO text
    (`Compiled.as_text()`). Source lines come from metadata source_file/source_line or, in newer
    XLA, from stack_frame_id (its innermost frame)."""
    head = re.match(r"HloModule ([^\s,]+)", text)
    module = head.group(1) if head else ""
    files, funcs = _numbered_section(text, "FileNames"), _numbered_section(text, "FunctionNames")
    locs, frames = _numbered_section(text, "FileLocations"), _numbered_section(text, "StackFrames")

    def frame_source(frame_id: int) -> str:
        ids = dict(re.findall(r"(\w+)=(\d+)", frames.get(frame_id, "")))
        loc = dict(re.findall(r"(\w+)=(\d+)", locs.get(int(ids.get("file_location_id", -1)), "")))
        if "file_name_id" not in loc:
            return ""
        func = funcs.get(int(loc.get("function_name_id", -1)), "").strip('"')
        path = _short_path(files.get(int(loc["file_name_id"]), "?"))
        return f"{path}:{loc.get('line', '?')} {func}"

    ops = {}
    comp, comp_stages, calls = "", collections.defaultdict(set), {}
    for line in text.splitlines():
        head = re.match(r"(?:ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):  # a computation's header
            comp = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT\s+)?%?([^\s=%]+) = (.*)", line)
        if not m:
            continue
        name, rest = m.groups()
        opcode = re.search(r"(?:^|\s)([a-z][a-z0-9\-]*)\(", rest)
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        meta = re.search(r"metadata=\{([^}]*)\}", rest)
        meta = meta.group(1) if meta else ""
        op_name = re.search(r'op_name="([^"]*)"', meta)
        source = ""
        if f := re.search(r'source_file="([^"]*)"', meta):
            line_no = re.search(r"source_line=(\d+)", meta)
            source = f"{_short_path(f.group(1))}:{line_no.group(1) if line_no else '?'}"
        elif sf := re.search(r"stack_frame_id=(\d+)", meta):
            source = frame_source(int(sf.group(1)))
        stage = stage_of(op_name.group(1)) if op_name else ""
        if stage:
            comp_stages[comp].add(stage)
        if c := re.search(r"(?:to_apply|calls)=%?([^\s,}]+)", rest):
            calls[name] = c.group(1)
        ops[name] = HloOp(
            opcode.group(1) if opcode else "",
            target.group(1) if target else "",
            op_name.group(1).rsplit("/", 1)[-1] if op_name else "",
            source,
            stage,
        )
    # An op without a stage of its own that calls a computation (a GPU command buffer, whose
    # kernels lose their op in the trace; a fusion XLA made without metadata) takes the stage of
    # the ops it calls when they are of one stage, else "mixed(...)".
    for name, callee in calls.items():
        op = ops[name]
        if not op.stage and op.opcode in ("call", "fusion") and comp_stages.get(callee):
            st = sorted(comp_stages[callee])
            ops[name] = dataclasses.replace(
                op, stage=st[0] if len(st) == 1 else f"mixed({'+'.join(st)})"
            )
    return module, ops


# Instructions that launch nothing: bookkeeping of the compiled program, and control flow.
NO_KERNEL = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "while",
        "conditional",
        "call",
        "after-all",
        "partition-id",
        "replica-id",
        "opt-barrier",
    }
)


def hlo_stage_counts(text: str) -> dict[str, dict]:
    """{stage: {opcode: count}} of the instructions a compiled program runs as its own kernels
    or thunks (those of the entry, while bodies / conditions, conditional branches and called
    computations; not those inside fusions or reducers; not `NO_KERNEL`), by the stage their
    op_name names (`stage_of`, OTHER where none). Static: a while body counts once."""
    comps, cur = collections.defaultdict(list), ""
    runs = set()
    for line in text.splitlines():
        head = re.match(r"(ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            cur = head.group(2)
            if head.group(1):
                runs.add(cur)
            continue
        m = re.match(r"\s*(?:ROOT\s+)?%?([^\s=%]+) = (.*)", line)
        if not m:
            continue
        rest = m.group(2)
        opcode = re.search(r"(?:^|\s)([a-z][a-z0-9\-]*)\(", rest)
        opcode = opcode.group(1) if opcode else ""
        for key in ("body", "condition"):
            if c := re.search(rf"\b{key}=%?([^\s,}}]+)", rest):
                runs.add(c.group(1))
        if c := re.search(r"branch_computations=\{([^}]*)\}", rest):
            runs.update(x.strip().lstrip("%") for x in c.group(1).split(","))
        if opcode == "call" and (c := re.search(r"to_apply=%?([^\s,}]+)", rest)):
            runs.add(c.group(1))
        op_name = re.search(r'op_name="([^"]*)"', rest)
        comps[cur].append((opcode, stage_of(op_name.group(1)) if op_name else ""))
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for comp in runs:
        for opcode, stage in comps.get(comp, []):
            if opcode and opcode not in NO_KERNEL:
                out[stage or OTHER][opcode] += 1
    return {k: dict(v.most_common()) for k, v in sorted(out.items())}


def kernel_names(ops: dict[str, HloOp]) -> dict[str, str]:
    """{kernel name: op} for XLA's own kernels, named after their op with '.' and '-' made '_'
    ("loop_add_fusion.3" -> "loop_add_fusion_3"): attributes kernels whose event lost its
    hlo_op (inside a command buffer)."""
    return {re.sub(r"[^0-9A-Za-z_]", "_", op): op for op in ops}


def category(text: str, fallback: str = "") -> str:
    """The CATEGORIES label of a kernel ("kernel hlo_op opcode target"), else of its op_name
    leaf (`fallback`), else "fusion (other)" / "other"."""
    for s in (text.lower(), fallback.lower()):
        for label, pattern in CATEGORIES:
            if s and re.search(pattern, s):
                return label
    return "fusion (other)" if "fusion" in text.lower() else "other"


# ============================================================================ aggregation


def exclusive_ns(events: list[Event]) -> list[float]:
    """Each event's duration minus that of the events nested in it on the same line."""
    own = [e.dur_ns for e in events]
    order = sorted(
        range(len(events)),
        key=lambda i: (events[i].plane, events[i].line, events[i].start_ns, -events[i].dur_ns),
    )
    stack: list[int] = []
    for i in order:
        e = events[i]
        while stack and (
            (events[stack[-1]].plane, events[stack[-1]].line) != (e.plane, e.line)
            or events[stack[-1]].end_ns <= e.start_ns
        ):
            stack.pop()
        if stack:
            own[stack[-1]] -= min(e.end_ns, events[stack[-1]].end_ns) - e.start_ns
        stack.append(i)
    return own


def union_ns(events: list[Event]) -> float:
    """Time during which at least one of the events runs."""
    total, end = 0.0, -float("inf")
    for e in sorted(events, key=lambda e: e.start_ns):
        if e.end_ns > end:
            total += e.end_ns - max(e.start_ns, end)
            end = e.end_ns
    return total


def op_events(events: list[Event], module: str, ops: dict[str, HloOp]) -> tuple[str, list, dict]:
    """The events that are the program's work: ("device" | "host", events, {other module: ms})."""
    where = "device"
    work = [
        e for e in events if _is_device(e.plane) and e.line not in DERIVED_LINES and e.dur_ns > 0
    ]
    planes = sorted({e.plane for e in work})
    if len(planes) > 1:  # tensor parallelism: every device runs the same program; count one
        work = [e for e in work if e.plane == planes[0]]
    if not work:  # no device plane (CPU): the host's thunk events
        where = "host"
        work = [
            e for e in events if e.plane == "/host:CPU" and "hlo_op" in e.stats and e.dur_ns > 0
        ]

    def mod(e):
        return str(e.stats.get("hlo_module", "")).split("(")[0]

    mine = [e for e in work if mod(e) in (module, "")]  # runtime memcpys carry no module
    others = collections.Counter()
    for e in work:
        if mod(e) not in (module, ""):
            others[mod(e)] += e.dur_ns / 1e6
    if not mine and work:  # names differ from the compiled one: keep all rather than nothing
        print(
            f"[profile] no event of module {module!r} (modules: {sorted(others)}): keeping all",
            file=sys.stderr,
        )
        mine, others = work, collections.Counter()
    if where == "host":
        mine = [e for e in mine if _opcode(str(e.stats["hlo_op"]), ops) not in CONTAINER_OPCODES]
    return where, mine, dict(others)


def _opcode(op: str, ops: dict[str, HloOp]) -> str:
    if op in ops:
        return ops[op].opcode
    m = re.match(r"(while|conditional|cond|call)\b", op)  # without the HLO text
    return {"cond": "conditional"}.get(m.group(1), m.group(1)) if m else ""


def attribute(e: Event, ops: dict[str, HloOp], by_kernel: dict[str, str]) -> str:
    """The HLO op a kernel ran for: its hlo_op stat, unless that is missing or a container (a
    command buffer's call, a while): then the op XLA named the kernel after, if there is one."""
    stat = str(e.stats.get("hlo_op", ""))
    if stat in ops and ops[stat].opcode not in CONTAINER_OPCODES:
        return stat
    return by_kernel.get(e.name) or stat or "(no hlo_op)"


OTHER = "other"  # kernels of no stage: the loop's own ops, XLA's copies, runtime memcpys


def between_stages(stages: list[str]) -> list[str]:
    """Stages of a stream's kernels in launch order, "" where a kernel's op names none, each ""
    filled with the stage of the kernels on both sides of it where the two agree (a kernel XLA
    created without metadata, such as the TopK custom call its sort became, inside one stage's
    run of kernels); left "" at a boundary between two stages, and at either end."""
    out = list(stages)
    prev = [""] * len(out)
    last = ""
    for i, st in enumerate(out):
        prev[i] = last
        last = st or last
    nxt = ""
    for i in range(len(out) - 1, -1, -1):
        if out[i]:
            nxt = out[i]
        elif prev[i] and prev[i] == nxt:
            out[i] = nxt
    return out


def summarise(events: list[Event], reps: int, hlo_text: str) -> dict:
    """Kernel time of one program's trace per repetition: totals, and the time by kernel name,
    by HLO op, by category, by source line and by step stage (the "stage_*" named scope in the
    op's metadata, `stage_of`; a kernel of no stage between two of one stage on its stream takes
    theirs, `between_stages`; OTHER where none) (rows sorted by time; share = of busy time)."""
    module, ops = parse_hlo(hlo_text)
    by_kernel = kernel_names(ops)
    where, work, others = op_events(events, module, ops)
    own = exclusive_ns(work)
    busy = sum(own)
    groups = {t: {} for t in ("kernel", "hlo_op", "category", "source", "stage")}
    attributed = 0.0
    names = [attribute(e, ops, by_kernel) for e in work]
    stage = {}  # event index -> stage, per stream in launch order
    order = sorted(range(len(work)), key=lambda i: (work[i].plane, work[i].line, work[i].start_ns))
    for _, stream in itertools.groupby(order, key=lambda i: (work[i].plane, work[i].line)):
        idx = list(stream)
        filled = between_stages([ops[names[i]].stage if names[i] in ops else "" for i in idx])
        stage.update(zip(idx, filled))
    for i, (e, ns) in enumerate(zip(work, own)):
        op = names[i]
        attributed += ns if op in ops and ops[op].opcode not in CONTAINER_OPCODES else 0.0
        info = ops.get(op, HloOp("", "", "", ""))
        cat = category(f"{e.name} {op} {info.opcode} {info.target}", info.op_leaf)
        keys = dict(
            kernel=e.name,
            hlo_op=op,
            category=cat,
            source=info.source or "(unknown)",
            stage=stage.get(i) or OTHER,
        )
        for table, key in keys.items():
            g = groups[table].setdefault(
                key, dict(ns=0.0, n=0, cat=cat, related=collections.Counter())
            )
            g["ns"] += ns
            g["n"] += 1
            g["related"][e.name if table == "hlo_op" else op] += ns

    def rows(table: str) -> list[dict]:
        out = []
        for key, g in sorted(groups[table].items(), key=lambda kv: -kv[1]["ns"]):
            row = {
                table: key,
                "ms_per_rep": g["ns"] / 1e6 / reps,
                "share": g["ns"] / busy if busy else 0.0,
                "calls_per_rep": g["n"] / reps,
            }
            if table in ("kernel", "hlo_op"):
                row["category"] = g["cat"]
            if table == "hlo_op":
                info = ops.get(key, HloOp("", "", "", ""))
                row.update(opcode=info.opcode, source=info.source, stage=info.stage)
            row["kernels" if table == "hlo_op" else "hlo_ops"] = [
                k for k, _ in g["related"].most_common(3)
            ]
            out.append(row)
        return out

    return dict(
        events_from=where,
        module=module,
        num_events=len(work),
        busy_ms_per_rep=busy / 1e6 / reps,
        active_ms_per_rep=union_ns(work) / 1e6 / reps,
        attributed_share=attributed / busy if busy else 0.0,
        other_modules_ms=others,
        kernels=rows("kernel"),
        hlo_ops=rows("hlo_op"),
        categories=rows("category"),
        sources=rows("source"),
        stages=rows("stage"),
    )


# ============================================================================ in-loop stages


def stage_split(
    r: dict,
    stages: tuple[str, ...],
    floors: dict | None = None,
    gbps: float | None = None,
    step_ms: float | None = None,
    flops: dict | None = None,
    tflops: float | None = None,
) -> list[dict]:
    """Per-step time of a loop program's trace (`summarise` result r, reps = loop steps) split by
    stage: one row per stage in `stages`, then "other" (kernels of no stage, and "mixed(...)"
    command buffers spanning stages), then "idle" (wall - active: the device waiting on
    launches and the loop's host round trips). Each stage row also counts its kernels per step
    (`kernels_per_step`: a launch-bound stage has many short ones). The stage and other rows sum
    to the busy time; with idle they sum to the wall time where kernels do not overlap (one GPU
    stream: busy = active); host traces (CPU) run thunks on several threads at once, so there
    busy can exceed active. floors: {stage: bytes} (bench.stage_floor_bytes); gbps: the peak
    bandwidth their times are computed at. flops: {stage: matmul flops}
    (bench.stage_floor_flops); tflops: the peak rate: a stage whose flops take longer than its
    bytes gets that floor (bound "compute"). step_ms: the step time of the loop as timed (the
    traced program is then a twin compiled for the trace, bench.TRACE_COMPILER_OPTIONS, whose
    launch gaps differ): idle is step_ms - busy and the shares are of step_ms, so the rows sum to
    the timed step."""
    ms = {row["stage"]: row["ms_per_rep"] for row in r.get("stages", [])}
    calls = {row["stage"]: row.get("calls_per_rep", 0.0) for row in r.get("stages", [])}
    flops = flops or {}
    wall = r["wall_ms_per_rep"] if step_ms is None else step_ms
    active = r["active_ms_per_rep"] if step_ms is None else r["busy_ms_per_rep"]
    out = []
    for st in stages:
        row = dict(stage=st, ms_per_step=ms.pop(st, 0.0), kernels_per_step=calls.pop(st, 0.0))
        if floors and st in floors:
            row["floor_mib"] = floors[st] / 2**20
            if gbps:
                row["floor_ms"] = floors[st] / (gbps * 1e6)
                row["bound"] = "bytes"
        if st in flops:
            row["floor_gflop"] = flops[st] / 1e9
            if tflops:
                row["flop_floor_ms"] = flops[st] / (tflops * 1e9)
                if "floor_ms" in row and row["flop_floor_ms"] > row["floor_ms"]:
                    row["floor_ms"], row["bound"] = row["flop_floor_ms"], "compute"
        if "floor_ms" in row:
            row["x_floor"] = row["ms_per_step"] / row["floor_ms"] if row["floor_ms"] else None
        out.append(row)
    out.append(
        dict(
            stage=OTHER,
            ms_per_step=sum(ms.values()),
            kernels_per_step=sum(calls.values()),
            detail={k: v for k, v in sorted(ms.items(), key=lambda kv: -kv[1])},
        )
    )
    out.append(dict(stage="idle", ms_per_step=max(wall - active, 0.0)))
    for row in out:
        row["share_of_wall"] = row["ms_per_step"] / wall if wall else 0.0
    return out


def print_stage_split(title: str, rows: list[dict]) -> str:
    cols = ["stage", "ms_per_step", "share_of_wall", "floor_mib", "floor_ms", "x_floor"]
    cols = [c for c in cols if any(c in r for r in rows)]
    fmt = lambda c, v: (
        f"{100 * v:.1f}%"
        if c == "share_of_wall"
        # noqa: E731
        else f"{v:.4g}"
        if isinstance(v, float)
        else ""
        if v is None
        else str(v)
    )
    print(f"\n{title}")
    return bench.print_table([{c: fmt(c, r.get(c)) for c in cols} for r in rows], cols)


# ============================================================================ report


def _cell(v, col: str) -> str:
    if col == "share":
        return f"{100 * v:.1f}%"
    if col == "ms_per_rep":
        return f"{v:.3f}"
    if col == "calls_per_rep":
        return f"{v:.3g}"
    s = ", ".join(v) if isinstance(v, list) else str(v)
    return s if len(s) <= 64 else s[:61] + "..."


def print_rows(title: str, rows: list[dict], cols: list[str], top: int) -> None:
    print(f"\n{title}" + (f" (top {top} of {len(rows)})" if len(rows) > top else ""))
    bench.print_table([{c: _cell(r.get(c, ""), c) for c in cols} for r in rows[:top]], cols)


def print_program(r: dict, top: int) -> None:
    idle = r["wall_ms_per_rep"] - r["active_ms_per_rep"]
    print(
        f"\n{'=' * 100}\n{r['program']} ({r['module'] or '?'}): {r['reps']} reps; "
        f"{r['events_from']} events of {r['trace']['reader']} ({r['trace']['file']})"
    )
    print(
        f"wall {r['wall_ms_per_rep']:.3f} ms/rep | {r['events_from']} busy "
        f"{r['busy_ms_per_rep']:.3f}, active {r['active_ms_per_rep']:.3f} ms/rep (wall - active "
        f"{idle:.3f}) | {r['num_events'] / r['reps']:.0f} "
        f"{'kernels' if r['events_from'] == 'device' else 'thunks'}/rep, "
        f"{100 * r['attributed_share']:.0f}% of the time attributed to HLO ops"
        + (f" | {r['tokens_per_step']:.2f} tokens/step" if "tokens_per_step" in r else "")
    )
    if r["other_modules_ms"]:
        print(
            "left out (other programs in the trace, ms in all): "
            + ", ".join(f"{m} {ms:.3f}" for m, ms in r["other_modules_ms"].items())
        )
    cols = ["ms_per_rep", "share", "calls_per_rep"]
    print_rows("by category", r["categories"], ["category", *cols, "hlo_ops"], top)
    print_rows("by HLO op", r["hlo_ops"], ["hlo_op", *cols, "category", "source", "kernels"], top)
    if any(k["kernel"] not in k["hlo_ops"] for k in r["kernels"]):  # GPU: names differ from ops
        print_rows("by kernel", r["kernels"], ["kernel", *cols, "category", "hlo_ops"], top)
    print_rows(
        "by source line (of each op's metadata)",
        r["sources"],
        ["source", *cols, "hlo_ops"],
        min(top, 15),
    )


def print_overview(results: dict) -> str:
    rows = []
    for name, r in results.items():
        cat, op = (r["categories"] or [{}])[0], (r["hlo_ops"] or [{}])[0]
        rows.append(
            dict(
                program=name,
                wall_ms=f"{r['wall_ms_per_rep']:.3f}",
                busy_ms=f"{r['busy_ms_per_rep']:.3f}",
                active_ms=f"{r['active_ms_per_rep']:.3f}",
                top_category=f"{cat.get('category', '-')} {100 * cat.get('share', 0):.0f}%",
                top_op=f"{op.get('hlo_op', '-')} {100 * op.get('share', 0):.0f}%",
            )
        )
    print(f"\n{'=' * 100}\nper repetition (a loop step for ar / step, a call for a stage)")
    return bench.print_table(rows, list(rows[0]))


# ============================================================================ programs


def _trace_options():
    """No Python tracer (its events would swamp the host plane); None where jax lacks the
    options."""
    try:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
        return opts
    except (AttributeError, TypeError):
        return None


def _hlo_text(exe) -> str:
    try:
        return exe.as_text() or ""
    except Exception as e:  # noqa: BLE001 - attribution is lost, the kernel tables remain
        print(f"[profile] no HLO text ({type(e).__name__}: {e}): ops unattributed", file=sys.stderr)
        return ""


class LoopRun:
    """The engine's jitted loop (`LLM.segment_fn`) on a carried, donated state: one call runs
    `n` steps."""

    def __init__(self, exe, params, state, n: int):
        self.exe, self.params, self.state, self.n = exe, params, state, n
        self.steps = jax.device_put(np.int32(n))  # made here: no transfer inside the trace

    def __call__(self) -> dict:
        t = time.perf_counter()
        self.state = self.exe(self.params, self.state, self.steps)
        jax.block_until_ready(self.state)
        return dict(wall_ms_per_rep=1e3 * (time.perf_counter() - t) / self.n)


class StageRun:
    """A stage of the spec step called `n` times, each on fresh arguments (made untimed)."""

    def __init__(self, exe, make_args, n: int):
        self.exe, self.make_args, self.n = exe, make_args, n

    def __call__(self) -> dict:
        ms = bench._median_ms(lambda args: self.exe(*args), self.n, self.make_args)
        return dict(wall_ms_per_rep=ms)


def profile_program(name: str, run, reps: int, exe, log_dir: str, reader: str) -> dict:
    """Trace `run()` (`reps` repetitions of program `exe`) into `log_dir` and summarise it."""
    os.makedirs(log_dir, exist_ok=True)
    with jax.profiler.trace(log_dir, profiler_options=_trace_options()):
        measured = run()
    trace, events = read_trace(log_dir, reader)
    result = summarise(events, reps, _hlo_text(exe))
    if result["events_from"] == "host" and jax.default_backend() != "cpu":
        print(
            f"[profile] {name}: no device events in the trace (is CUPTI available?): the times "
            "are the host's thunk events",
            file=sys.stderr,
        )
    return dict(program=name, reps=reps, **measured, trace=trace, **result)


def _e2e_args(a) -> argparse.Namespace:
    """The options bench.run_e2e's helpers read, from ours."""
    return argparse.Namespace(
        model=None,
        preset=a.preset,
        dtype=a.dtype,
        seed=a.seed,
        batch=[a.batch],
        prompt_len=a.prompt_len,
        modes=["ar", a.mode],
        tp=a.tp,
        draft_vocab=a.draft_vocab or None,
        nodes=a.nodes,
        calibration=None,
        budget=a.budget,
        topk=a.topk,
        depth=a.depth,
        backend=a.backend,
        lazy_commit=a.lazy_commit,
    )


def compile_programs(low: dict, workers: int) -> dict:
    pool = cf.ThreadPoolExecutor(workers)
    jobs = {name: pool.submit(lw.compile) for name, lw in low.items()}
    with progress_bar(len(jobs), "compile", "prog") as bar:
        for _ in cf.as_completed(jobs.values()):
            bar.update(1)
    pool.shutdown()
    return {name: job.result() for name, job in jobs.items()}


def run(a) -> dict:
    """Build the model and the prefilled batch as the bench does, compile, then profile each
    program in `a.programs`. Returns the result dict (what --out gets)."""
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    env = environment()
    compile_cache.enable(a.compile_cache)  # "none" = off
    e2e = _e2e_args(a)
    stages = [s for s in STAGES if s in a.programs]
    spec_wanted = bool(stages) or "step" in a.programs
    p = bench.synthetic_accept_prob(a.accept_mean, a.depth) if spec_wanted else None
    gen = 1 + (a.warm + a.reps) * (a.depth + 1)  # no request finishes inside the traced steps
    cfg, params, ids, _ = bench._e2e_model(e2e)
    plan = bench._plan_batch(e2e, cfg, params, ids, [a.mode] if spec_wanted else [], True, p, gen)
    base = bench._prefill(plan, gen, spec_wanted, stop_at_eos=False)
    spec = plan["specs"].get(a.mode)
    say(
        f"[profile] {a.preset}: B={a.batch}, {env['device']}, programs {a.programs}"
        + (f"; {spec.shape}, synthetic drafter p={p:.4f}" if spec else "")
    )
    phases = dict(setup_s=time.perf_counter() - t_start)

    def shapes(mode):
        return parallel.annotate(
            jax.eval_shape(
                lambda s: bench._derive_state(s, mode, spec if mode != "ar" else None, cfg), base
            ),
            cfg,
        )

    # Lowered here, compiled in threads. The AR loop also makes the drafter's oracle.
    t = time.perf_counter()
    low = dict(ar=plan["llms"]["ar"].segment_fn("ar").lower(params, shapes("ar"), jnp.int32(0)))
    if "step" in a.programs:
        low["step"] = (
            plan["llms"][a.mode].segment_fn(a.mode).lower(params, shapes(a.mode), jnp.int32(0))
        )
    if stages:  # bench.stage_inputs runs draft..accept to make the inputs of any stage
        needed = {"draft", "select", "verify", "accept", *stages}
        lowered = bench.lower_stages(bench.stage_functions(cfg, spec), params, shapes(a.mode))
        low.update({name: lw for name, lw in lowered.items() if name in needed})
    exe = compile_programs(low, a.compile_workers)
    phases["compile_s"] = time.perf_counter() - t
    say(f"[profile] {len(exe)} programs compiled in {phases['compile_s']:.0f} s")

    t = time.perf_counter()
    results, floors = {}, {}
    with tempfile.TemporaryDirectory(prefix="profile_step_") as tmp:
        root = a.trace_dir or tmp

        def profile(name, runner):
            say(f"[profile] tracing {name}")
            results[name] = profile_program(
                name, runner, a.reps, exe[name], os.path.join(root, name), a.trace_reader
            )

        if "ar" in a.programs:
            st = exe["ar"](params, bench._derive_state(base, "ar", None, cfg), jnp.int32(a.warm))
            floors["ar"] = dict(ar=bench.ar_step_floor_bytes(cfg, params, st.cache, a.batch))
            profile("ar", LoopRun(exe["ar"], params, jax.block_until_ready(st), a.reps))
        if spec_wanted:
            st = exe["ar"](params, bench._derive_state(base, "ar", None, cfg), jnp.int32(gen))
            oracle = bench.synthetic_oracle(np.asarray(st.out))
            st = bench._derive_state(base, a.mode, spec, cfg, oracle)
            if (
                stages
            ):  # the first spec step's inputs (shapes are static: any step runs the same kernels)
                inputs = bench.stage_inputs(exe, params, st)
                for name in stages:
                    if a.warm:
                        bench._median_ms(lambda args, f=exe[name]: f(*args), a.warm, inputs[name])
                    profile(name, StageRun(exe[name], inputs[name], a.reps))
                del inputs  # it holds st's cache, which the step loop donates
            if "step" in a.programs:
                st = jax.block_until_ready(exe["step"](params, st, jnp.int32(a.warm)))
                floors["step"] = bench.stage_floor_bytes(cfg, params, st, spec)
                n0, s0 = np.asarray(st.num_out), np.asarray(st.steps)
                loop = LoopRun(exe["step"], params, st, a.reps)
                profile("step", loop)
                n1, s1 = np.asarray(loop.state.num_out), np.asarray(loop.state.steps)
                results["step"]["tokens_per_step"] = float(
                    (n1 - n0).sum() / max((s1 - s0).sum(), 1)
                )
        if a.trace_dir:
            say(f"[profile] raw traces kept under {a.trace_dir}/<program>/plugins/profile/")
    phases["profile_s"] = time.perf_counter() - t

    gbps = bench.peak_gbps()
    splits = {}
    if "ar" in results:
        splits["ar"] = stage_split(results["ar"], ("ar",), floors.get("ar"), gbps)
    if "step" in results:
        splits["step"] = stage_split(results["step"], STAGES, floors.get("step"), gbps)
    for name in a.programs:
        print_program(results[name], a.top)
    for name, rows in splits.items():
        results[name]["stage_split"] = rows
        print_stage_split(
            f"in-loop stage split of {name} ({a.mode if name == 'step' else 'ar'}, "
            f"B={a.batch}; ms per loop step"
            + (f"; floors at {gbps:.0f} GB/s" if gbps else "")
            + ")",
            rows,
        )
    table = print_overview({name: results[name] for name in a.programs})
    out = dict(
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        env=env,
        args=vars(a),
        config=cfg,
        spec=spec,
        synthetic_accept=p,
        gen_tokens=gen,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        phases=phases,
        overview=table,
        programs={name: results[name] for name in a.programs},
    )
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        bench.write_json(a.out, out)
        say(f"[profile] wrote {a.out}")
    return out


# ============================================================================ CLI


def parse_args(argv=None) -> argparse.Namespace:
    from bole_jax.serving.cli import XLA_CACHE

    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n")[1:]),
    )
    ap.add_argument("--preset", default="qwen3.5-9b", help="random-weight model dims (presets.py)")
    ap.add_argument("--batch", type=int, default=16, help="requests decoded together")
    ap.add_argument("--nodes", type=int, default=8, help="tree width: verified nodes per request")
    ap.add_argument("--depth", type=int, default=8, help="max draft depth")
    ap.add_argument("--topk", type=int, default=4, help="children expanded per frontier node")
    ap.add_argument(
        "--budget",
        default="none",
        help="verified nodes across the batch (an int), or none: --nodes per request",
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument(
        "--reps",
        type=int,
        default=10,
        help="traced repetitions: loop steps of ar / step, calls of a stage",
    )
    ap.add_argument(
        "--warm",
        type=int,
        default=3,
        help="untraced repetitions first (loop steps, calls of a stage)",
    )
    ap.add_argument("--programs", nargs="+", default=list(DEFAULT_PROGRAMS), choices=PROGRAMS)
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=32768,
        help="tokens the MTP drafter scores (0: the whole vocabulary)",
    )
    ap.add_argument(
        "--accept-mean",
        type=float,
        default=6.4,
        help="synthetic drafter: mean tokens per step (sets p, as in the bench)",
    )
    ap.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "pallas", "reference"],
        help="tree kernels of the spec step (the JAX platform: JAX_PLATFORMS)",
    )
    ap.add_argument(
        "--mode",
        default="bole",
        choices=[m for m in bench.E2E_MODES if m != "ar"],
        help="the spec mode of the step and stage programs (GDN verify and commit)",
    )
    ap.add_argument("--lazy-commit", action="store_true", help="bole with the lazy GDN commit")
    ap.add_argument(
        "--dtype", default=None, choices=["bfloat16", "float32"], help="weights (default bfloat16)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel devices (programs ar and step only; the device tables "
        "count the first device's kernels)",
    )
    ap.add_argument(
        "--no-command-buffer",
        action="store_true",
        help="GPU: XLA flag --xla_gpu_enable_command_buffer= (each kernel launched "
        "alone: every kernel keeps its HLO op in the trace)",
    )
    ap.add_argument(
        "--trace-reader",
        default="auto",
        choices=["auto", "xplane", "json"],
        help="auto: the xplane.pb, else the trace.json.gz",
    )
    ap.add_argument("--top", type=int, default=30, help="rows per printed table")
    ap.add_argument(
        "--out",
        help="JSON result (default benchmarks/results/"
        "profile_<preset>_b<batch>.json; 'none' to skip)",
    )
    ap.add_argument("--trace-dir", help="keep the raw traces here (<dir>/<program>/...)")
    ap.add_argument("--compile-cache", default=XLA_CACHE, help="persistent XLA cache ('none': off)")
    ap.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1))
    a = ap.parse_args(argv)
    for name in ("batch", "nodes", "depth", "topk", "prompt_len", "reps", "top", "compile_workers"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.lazy_commit and a.mode != "bole":
        ap.error("--lazy-commit is bole's (--mode bole)")
    if a.warm < 0 or a.draft_vocab < 0:
        ap.error("--warm and --draft-vocab must be >= 0")
    if a.budget != "none":
        try:
            a.budget = int(a.budget)
        except ValueError:
            ap.error(f"--budget must be a positive int or none, got {a.budget!r}")
    a.programs = list(dict.fromkeys(a.programs))
    if a.tp < 1:
        ap.error("--tp must be >= 1")
    if a.tp > 1 and set(a.programs) - {"ar", "step"}:
        ap.error(
            "with --tp > 1 only the programs ar and step can be profiled (the stage programs "
            f"are not laid out for a mesh here), got {a.programs}"
        )
    if a.out is None:
        a.out = os.path.join("benchmarks", "results", f"profile_{a.preset}_b{a.batch}.json")
    elif a.out.lower() == "none":
        a.out = None
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.no_command_buffer:  # read when the backend starts, which is below
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
        ).strip()
    try:
        run(a)
    except (ValueError, FileNotFoundError) as e:  # bad options: say which, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
