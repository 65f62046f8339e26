"""JAX's persistent compilation cache, on by default for `bole_jax.LLM` and every `bole-jax` command.

Compiled XLA programs are written to a user cache folder, so a second process running the same
programs (same shapes, model config, jax version and device) loads them instead of compiling.

Folder, first match wins:
  1. the explicit argument (`LLM(compile_cache=DIR)`, `bole-jax ... --compile-cache DIR`);
  2. $BOLE_JAX_COMPILE_CACHE (a folder; "0", "off", "none" or "false" turn the cache off);
  3. jax's own setting, when the user set one (`JAX_COMPILATION_CACHE_DIR` or jax.config);
  4. $BOLE_JAX_CACHE/xla, else $XDG_CACHE_HOME/bole_jax/xla (default ~/.cache/bole_jax/xla).
An explicit argument of "none" (or False) also turns it off.

On CPU every program is cached (jax's default skips programs that compiled in under a second,
which on CPU is most of them, and loading one costs milliseconds).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENV_FOLDER = "BOLE_JAX_COMPILE_CACHE"
OFF = ("0", "off", "none", "false", "no")
MIN_COMPILE_TIME_S = {"cpu": 0.0}  # other backends: jax's default (1 s)


def default_dir() -> str:
    """$BOLE_JAX_CACHE/xla, else $XDG_CACHE_HOME/bole_jax/xla (~/.cache/bole_jax/xla)."""
    root = os.environ.get("BOLE_JAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "bole_jax",
    )
    return os.path.join(root, "xla")


def flag_default() -> str:
    """Default of the `--compile-cache` flags, without importing jax: $BOLE_JAX_COMPILE_CACHE
    ("none" when it says off), else $JAX_COMPILATION_CACHE_DIR, else `default_dir()`."""
    env = (os.environ.get(ENV_FOLDER) or "").strip()
    if env:
        return "none" if env.lower() in OFF else env
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_dir()


def resolve(path: str | os.PathLike | bool | None = None) -> str | None:
    """The folder the cache would use for `path` (see the module docstring), or None for off."""
    if path is False:
        return None
    if path is not None and path is not True:
        path = os.fspath(path)
        return None if path.strip().lower() in OFF else path
    env = os.environ.get(ENV_FOLDER)
    if env is not None and env.strip():
        return None if env.strip().lower() in OFF else env
    import jax

    return jax.config.jax_compilation_cache_dir or default_dir()


def enable(path: str | os.PathLike | bool | None = None) -> str | None:
    """Turn the persistent cache on at the resolved folder (made if missing); returns it, or None
    when the cache is off. Idempotent; a new folder takes effect for the next compilation."""
    folder = resolve(path)
    if folder is None:
        return None
    import jax

    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:  # a read-only home must not stop generation
        log.warning(
            "persistent compilation cache off: cannot create %s (%s); set %s to a "
            "writable folder or to 0",
            folder,
            e.strerror or e,
            ENV_FOLDER,
        )
        return None
    if jax.config.jax_compilation_cache_dir != folder:
        if jax.config.jax_compilation_cache_dir is not None:
            _reset()  # jax opens its cache folder once: reopen it at the new one
        jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_enable_compilation_cache", True)
    min_s = MIN_COMPILE_TIME_S.get(jax.default_backend())
    if min_s is not None and jax.config.jax_persistent_cache_min_compile_time_secs > min_s:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_s)
    return folder


def _reset() -> None:
    try:
        from jax._src import compilation_cache
    except ImportError:  # private module moved: the old folder stays in use
        return
    compilation_cache.reset_cache()
