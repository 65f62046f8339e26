"""benchmarks/with_xla_options.py: its overrides reach every compile, nested jits included
(a made-up field fails the compile, a real one compiles), and the script runs as __main__."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "with_xla_options.py")
NESTED = """
import os
import jax, jax.numpy as jnp
inner = jax.jit(lambda x: x * 2)
print("out", jax.jit(lambda x: inner(x) + 1)(jnp.ones(3)).tolist(), os.environ["BOLE_XLA_OPTIONS"])
"""


def _run(tmp_path, *options):
    prog = tmp_path / "prog.py"
    prog.write_text(NESTED)
    args = [a for o in options for a in ("--option", o)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, SCRIPT, *args, "--", str(prog)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_a_real_field_compiles_and_is_recorded(tmp_path):
    res = _run(tmp_path, "xla_gpu_ptx_compiler_extra_flags=--maxrregcount=128")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "out [3.0, 3.0, 3.0] xla_gpu_ptx_compiler_extra_flags=--maxrregcount=128" in res.stdout


def test_an_unknown_field_fails_the_compile(tmp_path):
    res = _run(tmp_path, "xla_no_such_field_here=1")
    assert res.returncode != 0
    assert "No such compile option" in res.stderr


def test_bad_option_syntax():
    from benchmarks import with_xla_options as wxo
    assert wxo.parse_options(["a=b=c", "x="]) == [("a", "b=c"), ("x", "")]
    with pytest.raises(ValueError, match="name=value"):
        wxo.parse_options(["novalue"])
