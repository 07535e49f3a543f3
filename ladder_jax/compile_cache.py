"""JAX's persistent compilation cache for the commands (serve, decode, eval, train), on by
default: a second start loads the same programs from disk. `LADDER_COMPILE_CACHE` (a
directory, or `off`): docs/inference.md, 'Serve' ("Fast restarts").

    compile_cache.enable()   # before the first compile: the directory used, or None
    with compile_cache.Counts() as counts: ...   # counts.hits: programs loaded from it"""

from __future__ import annotations

import os
import sys

import jax

ENV = "LADDER_COMPILE_CACHE"
OFF = ("off", "0", "no", "false")
MIN_COMPILE_S = 0.2
HIT, MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def directory() -> str | None:
    """The cache directory the environment asks for, or None (off)."""
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in OFF:
        return None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    if setting:
        return os.path.abspath(os.path.expanduser(setting))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ladder_jax", "xla")


def enable(off: bool = False) -> str | None:
    """Turns the cache on (unless `off` or the environment says off); the directory, or None."""
    path = None if off else directory()
    if path is None or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return path  # off, or jax's own variable: jax read it at import
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        print(
            f"note: no compilation cache: cannot make {path} ({e.strerror or e}); set {ENV} to "
            f"a writable directory or to off",
            file=sys.stderr,
            flush=True,
        )
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    if not os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):  # else jax read it
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    return path


class Counts:
    """Programs loaded from the cache (`hits`) and looked up there in vain (`misses`) while the
    `with` block runs, from jax's monitoring events (nothing is counted with the cache off).

        with Counts() as counts: warm_up(); print(counts.hits)"""

    def __enter__(self) -> "Counts":
        self.hits = self.misses = 0
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_listener(self._event)

    def _event(self, event: str, **_) -> None:
        if event == HIT:
            self.hits += 1
        elif event == MISS:
            self.misses += 1
