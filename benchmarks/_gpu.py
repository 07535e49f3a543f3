"""What the GPU benchmarks share (decode_matmul.py, calibrate_gpu.py, paged_attention.py): the
start (a dry run on the CPU, else a GPU or one line and exit code 2) and the timer.

    import _gpu  # a script run from benchmarks/ has this folder on sys.path
    if not _gpu.ready(args.dry_run):
        return 2

Invariant: without --dry-run nothing runs, and nothing is written, unless jax's first device
is a GPU.
"""

from __future__ import annotations

import sys
import time

NO_GPU = "error: no GPU here: run on a GPU, or pass --dry-run to check the script on CPU"


def ready(dry_run: bool) -> bool:
    """Whether the script may go on: a dry run (jax then uses the CPU), or jax's first device is
    a GPU; otherwise `NO_GPU` on stderr and False (the caller exits 2). The CUDA plugin's
    start-up lines are left out (`runtime.quiet`)."""
    from ladder_jax import runtime

    with runtime.quiet():  # the CUDA plugin's start-up lines
        import jax

    if dry_run:
        jax.config.update("jax_platforms", "cpu")
        return True
    with runtime.quiet():
        platform = jax.devices()[0].platform
    if platform == "gpu":
        return True
    print(NO_GPU, file=sys.stderr)
    return False


def best(fn, repeats: int) -> float:
    """Fastest of `repeats` timed calls of `fn` (after one warm-up call that compiles)."""
    import jax

    jax.block_until_ready(fn())
    fastest = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        fastest = min(fastest, time.perf_counter() - t0)
    return fastest
