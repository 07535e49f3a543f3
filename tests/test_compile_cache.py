"""JAX's persistent compilation cache in the commands (`ladder_jax.compile_cache`): a second
start of the same command compiles nothing anew, counted by the cache directory's entries."""

import os
import subprocess
import sys

DECODE = ("--preset", "tiny", "--prompt", "hi", "--max-new-tokens", "3", "--tp", "1")


def _decode(cache: str | None, home=None):
    """decode's stdout, with LADDER_COMPILE_CACHE=cache (None: unset) and XDG_CACHE_HOME=home."""
    drop = ("JAX_COMPILATION_CACHE_DIR", "LADDER_COMPILE_CACHE", "XDG_CACHE_HOME")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.update({"LADDER_COMPILE_CACHE": cache} if cache is not None else {})
    env.update({"XDG_CACHE_HOME": str(home)} if home is not None else {})
    r = subprocess.run(
        [sys.executable, "-m", "ladder_jax.decode", *DECODE],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def _entries(path) -> dict[str, int]:
    """The cached programs (jax's access-time files left out) and when each was written."""
    return {
        e.name: e.stat().st_mtime_ns
        for e in os.scandir(path)
        if e.is_file() and not e.name.endswith("-atime")
    }


def test_a_second_start_loads_every_program_from_the_user_cache(tmp_path):
    """On by default, in $XDG_CACHE_HOME/ladder_jax/xla."""
    cache = tmp_path / "ladder_jax" / "xla"
    first = _decode(None, home=tmp_path)
    stored = _entries(cache)
    assert any(name.startswith("jit_") for name in stored), stored  # the programs it compiled
    assert _decode(None, home=tmp_path) == first
    assert _entries(cache) == stored  # none added, none written again: every one was a hit


def test_off_writes_nothing(tmp_path):
    _decode("off", home=tmp_path / "off")
    assert not (tmp_path / "off").exists()


def test_the_flag_writes_nothing(tmp_path):
    """decode --no-compile-cache (serve's and eval's flag too): the default cache stays empty."""
    env = {k: v for k, v in os.environ.items() if k not in ("LADDER_COMPILE_CACHE",)}
    env.update(JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path))
    r = subprocess.run(
        [sys.executable, "-m", "ladder_jax.decode", *DECODE, "--no-compile-cache"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "ladder_jax").exists()


COUNT = """
import sys, jax, jax.numpy as jnp
from ladder_jax import compile_cache
compile_cache.enable()
f = lambda x: jnp.sin(x) @ x.T
with compile_cache.Counts() as counts:
    jax.jit(f)(jnp.ones((64, 64))).block_until_ready()
print(counts.hits, counts.misses)
"""


def test_counts_tell_a_program_loaded_from_the_cache(tmp_path):
    """`compile_cache.Counts` (what serve's warm-up reports): misses in a fresh process, as
    many hits in the next one with the same cache."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(
        JAX_PLATFORMS="cpu",
        LADDER_COMPILE_CACHE=str(tmp_path),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", COUNT], capture_output=True, text=True, timeout=120, env=env
        )
        for _ in range(2)
    ]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr
    (hits, misses), (hits2, misses2) = (map(int, r.stdout.split()) for r in runs)
    assert hits == 0 and misses >= 1  # the jitted function and the arrays it builds
    assert (hits2, misses2) == (misses, 0)  # each one loaded, none compiled


SERVE = ("--preset", "tiny", "--max-len", "16", "--slots", "2", "--prefills-per-step", "1")


def _serve_warmup(cache) -> list[str]:
    """serve's warm-up lines (2 programs: a 1 x 16 prefill, the decode round), then SIGTERM."""
    from tests.helpers import free_port, stop_server

    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="", LADDER_COMPILE_CACHE=str(cache))
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    args = ["--steps-per-plan", "1", "--tp", "1", "--port", str(free_port())]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ladder_jax.serve", *SERVE, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        lines = []
        for line in proc.stderr:  # bounded: the process ends, or its last warm-up line comes
            if line.startswith("warm-up ") and "/" in line.split()[1]:
                lines.append(line.strip())
            if line.startswith("warm-up 2/2"):
                break
        return lines
    finally:
        stop_server(proc)


def test_a_second_serve_start_loads_its_warm_up_from_the_cache(tmp_path):
    """serve's warm-up says per program whether it came from the compilation cache: none on a
    first start, every one on the second."""
    first = _serve_warmup(tmp_path)
    second = _serve_warmup(tmp_path)
    assert len(first) == len(second) == 2, (first, second)
    assert not any("from the compilation cache" in line for line in first), first
    assert all("from the compilation cache" in line for line in second), second
