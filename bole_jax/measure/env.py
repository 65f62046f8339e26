"""What a measurement records about where it ran, and the small tools every benchmark shares:
the environment (device, jax, git commit), the device copy bandwidth, a progress bar, the
persistent compilation cache."""

from __future__ import annotations

import os
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np


def environment() -> dict:
    """What a result needs to be comparable: device, jax version, git commit."""
    # The GPU machine gets a copy of the tree without usable git history: callers pass the commit.
    commit = os.environ.get("BOLE_GIT_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--verify", "-q", "HEAD"],
                capture_output=True,
                text=True,
                cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                timeout=10,
            ).stdout.strip()
        except Exception:  # noqa: BLE001 - best effort outside a checkout
            commit = ""
    d = jax.devices()[0]
    return dict(
        device=d.device_kind,
        platform=d.platform,
        num_devices=jax.device_count(),
        jax=jax.__version__,
        python=platform.python_version(),
        git_commit=commit or "unknown",
    )


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Measured device copy bandwidth in bytes/s (bytes read + bytes written)."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 2 * nbytes / float(np.median(ts))


class _TextBar:
    """Stand-in for tqdm when it is not installed (a line per update on stderr)."""

    def __init__(self, total: int, desc: str):
        self.n, self.total, self.desc = 0, total, desc

    def update(self, k: int = 1) -> None:
        import sys

        self.n += k
        print(f"{self.desc}: {self.n}/{self.total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def progress_bar(total: int, desc: str, unit: str = "it"):
    """A tqdm bar on stderr (or a plain-text stand-in when tqdm is missing)."""
    import sys

    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _TextBar(total, desc)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)
