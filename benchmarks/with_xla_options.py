"""Run a script with XLA DebugOptions overrides on every compile it makes.

    python benchmarks/with_xla_options.py \\
        --option xla_gpu_ptx_compiler_extra_flags=--maxrregcount=128 \\
        -- benchmarks/bench_tree_gdn.py --B 16 --N 8 ...

Some DebugOptions fields have no XLA_FLAGS flag (jax 0.11.2's XLA rejects
`--xla_gpu_asm_extra_flags`, and the ptxas options field `xla_gpu_ptx_compiler_extra_flags`
is a proto field only). `jax.jit(compiler_options=)` sets them, but only on a top-level jit,
and the kernels' wrappers are nested jits. This script instead appends each override to the
compile options of every compile (`jax._src.compiler.get_compile_options`), then runs the
script as `__main__`. An unknown field fails that compile ("No such compile option"). The
overrides go in the environment as BOLE_XLA_OPTIONS (name=value;...), and bench_tree_gdn.py
records them in its JSON.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys


def parse_options(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--option: expected name=value, got {item!r}")
        out.append((name, value))
    return out


def install(options: list[tuple[str, str]]) -> None:
    """Append `options` to the option overrides of every later XLA compile in this process."""
    from jax._src import compiler

    orig = compiler.get_compile_options

    def get_compile_options(*a, **kw):
        opts = orig(*a, **kw)
        opts.env_option_overrides = list(opts.env_option_overrides) + list(options)
        return opts

    compiler.get_compile_options = get_compile_options
    os.environ["BOLE_XLA_OPTIONS"] = ";".join(f"{k}={v}" for k, v in options)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        sys.exit("usage: with_xla_options.py --option name=value [...] -- script.py [args]")
    i = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                    help="a DebugOptions field and its value (repeatable)")
    args = ap.parse_args(argv[:i])
    rest = argv[i + 1:]
    if not rest:
        ap.error("no script after --")
    try:
        options = parse_options(args.option)
    except ValueError as e:
        ap.error(str(e))
    install(options)
    sys.argv = rest
    sys.path.insert(0, os.path.dirname(os.path.abspath(rest[0])))
    runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main()
