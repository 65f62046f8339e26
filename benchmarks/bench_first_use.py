"""First use: the wall time of the README's main command in a fresh process, with an empty
persistent compilation cache (a new user's first run) and again with the cache it left (every
later run), a few times over.

Each run is `bole-jax generate PROMPT [ARGS]` in a subprocess with `BOLE_JAX_CACHE` pointing at a
new temporary folder (cold), then the same command with the same folder (warm). The wall covers
everything a user waits for: the interpreter, imports, loading the model, compiling (or reading
the compiled programs back) and decoding. Prints a table and writes first_use.json (the command,
git commit, device, jax version).

    python benchmarks/bench_first_use.py --reps 3 --out DIR
    python benchmarks/bench_first_use.py --reps 3 --out DIR -- --spec bole   # CLI args after --
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bole_jax.measure.bench import print_table, write_json  # noqa: E402
from bole_jax.measure.env import environment  # noqa: E402

PROMPT = "def fibonacci(n):"


def run_once(cmd: list[str], cache: str) -> tuple[float, str]:
    """(wall seconds, the command's last output line) of one fresh process."""
    env = dict(os.environ, BOLE_JAX_CACHE=cache)
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    lines = [x for x in (p.stdout + p.stderr).splitlines() if x.strip()]
    return wall, lines[-1] if lines else ""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="cold + warm pairs (default 3)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--out", required=True, help="folder for first_use.json")
    ap.add_argument("cli_args", nargs="*", help="more `bole-jax generate` arguments (after --)")
    a = ap.parse_args(argv)
    if a.reps < 1:
        ap.error("--reps must be >= 1")
    cmd = [sys.executable, "-m", "bole_jax", "generate", a.prompt, *a.cli_args]
    rows = []
    for rep in range(a.reps):
        cache = tempfile.mkdtemp(prefix="bole_first_use_")
        try:
            cold, last = run_once(cmd, cache)
            warm, _ = run_once(cmd, cache)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        rows.append(dict(rep=rep, cold_s=round(cold, 3), warm_s=round(warm, 3), last_line=last))
        print(f"[first-use] rep {rep}: cold {cold:.2f} s, warm {warm:.2f} s", flush=True)
    summary = dict(
        cold_s_median=statistics.median(r["cold_s"] for r in rows),
        warm_s_median=statistics.median(r["warm_s"] for r in rows),
    )
    print_table(rows, ["rep", "cold_s", "warm_s", "last_line"])
    print(f"median: cold {summary['cold_s_median']:.2f} s, warm {summary['warm_s_median']:.2f} s")
    os.makedirs(a.out, exist_ok=True)
    write_json(
        os.path.join(a.out, "first_use.json"),
        dict(
            command=" ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
            run=" ".join(cmd[1:]),
            env=dict(environment(), cpu_count=os.cpu_count(), load_avg=os.getloadavg()),
            rows=rows,
            summary=summary,
        ),
    )


if __name__ == "__main__":
    main()
