"""The compiled programs the performance model reads: a request shape (`Workload`), the kernels
of its prefill, decode-step or training program (`program_kernels`, compiled once per process
and shape), and the depths compiled for a model (`compiled_depths`: all its layers, or a few
and one period of layers fewer, extended linearly by the costing).

    w = Workload(tp=8, batch=1, prompt_len=1024, new_tokens=512)
    kernels = program_kernels(config, w, phase="decode").kernels"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time

from ladder_jax.analysis import programs
from ladder_jax.analysis.kernels import PredictError, read_kernels
from ladder_jax.inference.cache import cache_length


@dataclasses.dataclass(frozen=True)
class Workload:
    """One request shape on one tensor-parallel group: `tp` GPUs of `target` over `hosts`
    hosts, `batch` rows of `prompt_len` prompt tokens and `new_tokens` generated ones (a
    training step: `prompt_len` is the sequence length, `new_tokens` 1); `slots`: the decode
    cache's slots per row (a server's `--max-len`; None: sized for the request); `allreduce`:
    how the programs' all-reduces run (`compilation.ALLREDUCES`: "nccl", "one_shot")."""

    tp: int
    batch: int
    prompt_len: int
    new_tokens: int
    target: str = "h100"
    hosts: int = 1
    slots: int | None = None
    allreduce: str = "nccl"


@dataclasses.dataclass(frozen=True)
class Program:
    kernels: tuple
    fallback: str | None = None


def decode_fill(config, workload: Workload) -> float:
    """The fraction of a decode cache's slots that the average step of a request reads: its
    mid-decode length, prompt_len + new_tokens / 2, over the slots per row (`slots`, or what
    `decode` sizes for the request: then about 1 - new_tokens / 2 / slots)."""
    w = workload
    S = w.slots or cache_length(config, w.prompt_len, w.new_tokens)
    return min(1.0, (w.prompt_len + w.new_tokens / 2) / S)


def program_kernels(config, workload: Workload, *, phase: str) -> Program:
    """The kernels of `config`'s `phase` program ("prefill", "decode", "train") for
    `workload`, compiled once per process and shape however the arguments are spelled (the
    persistent cache of `ladder_jax.analysis.programs` keeps them across processes). The
    decode step's attention reads the request's average filled length of the cache's slots
    (`decode_fill`)."""
    return _program(config, workload, phase)


@functools.lru_cache(maxsize=None)
def _program(config, w: Workload, phase: str) -> Program:
    """`program_kernels`, its arguments in one order: one cache entry per program."""
    text, _ = programs.compile_program(
        config,
        phase=phase,
        tp=w.tp,
        batch=w.batch,
        seq=w.prompt_len,
        target=w.target,
        new_tokens=w.new_tokens,
        hosts=w.hosts,
        **({"slots": w.slots} if w.slots is not None else {}),
        **({"allreduce": w.allreduce} if w.allreduce != "nccl" else {}),
    )
    fallback = programs.LAST["fallback"]
    filled = decode_fill(config, w) if phase == "decode" else 1.0
    kernels = read_kernels(
        text,
        devices=w.tp,
        gpus_per_host=w.tp // w.hosts,
        filled=filled,
        allreduce=w.allreduce,
    )
    return Program(tuple(kernels), fallback)


program_kernels.cache_info = _program.cache_info
program_kernels.cache_clear = _program.cache_clear


def check_layers_compiled(layers_compiled: int) -> None:
    if layers_compiled != 0 and layers_compiled < 2:
        raise PredictError(
            f"--layers-compiled {layers_compiled}: use 0 (full depth) or >= 2 "
            f"(that many layers and one fewer are compiled; 4 is accurate)"
        )


def layer_period(config) -> int | None:
    """Layers after which `config`'s wiring repeats: 2 for desync every_2_layers (a synced
    layer after each unsynced one), None for an explicit per-layer wiring (hybrid ladder
    layers, desync pairs: compiled at full depth), else 1."""
    if config.ladder_layers is not None:
        return None
    if config.residual == "desync":
        return {"every_2_layers": 2, None: 1, "every_layer": 1, "final_only": 1}.get(
            config.reduce_pattern
        )
    return 1


def compiled_depths(config, layers_compiled: int) -> list[int]:
    """The depths compiled for `config`: all layers, or `layers_compiled` and one period of
    layers fewer (`layer_period`; one layer for a uniform model), the deeper of the two as
    many periods short of the full depth as it takes."""
    check_layers_compiled(layers_compiled)
    period = layer_period(config)
    if not layers_compiled or period is None:
        return [config.n_layers]
    deep = layers_compiled
    while deep - period < 1 or (config.n_layers - deep) % period:
        deep += 1
    if config.n_layers <= deep:
        return [config.n_layers]
    return [deep - period, deep]


def compile_all(tasks: list[dict], jobs: int | None = None, progress=None) -> None:
    """Compiles the `program_kernels(**task)` of every task, `jobs` threads at a time
    (default 1: tracing and lowering hold Python's lock, so threads pay off only on idle
    cores), so that later calls hit the cache. `progress(done, total, eta_s)` is called
    before the first and after every program (eta_s None until one was compiled)."""
    todo = list({tuple(sorted(t.items())): t for t in tasks}.values())
    jobs = max(1, jobs or 1)
    t0, compiled = time.perf_counter(), 0
    if progress:
        progress(0, len(todo), None)
    pool = concurrent.futures.ThreadPoolExecutor(jobs)
    try:
        futures = [pool.submit(_compile_one, t) for t in todo]
        for done, f in enumerate(concurrent.futures.as_completed(futures), 1):
            compiled += f.result()
            if progress:
                rate = (time.perf_counter() - t0) / compiled if compiled else None
                progress(done, len(todo), None if rate is None else rate * (len(todo) - done))
    finally:  # a failure stops at once: the programs still queued are not compiled
        pool.shutdown(wait=True, cancel_futures=True)


def _compile_one(task: dict) -> bool:
    """program_kernels(**task); True when it was compiled (not found in a cache)."""
    before = program_kernels.cache_info().hits
    hits = programs.CACHE_STATS["hits"]
    program_kernels(**task)
    return program_kernels.cache_info().hits == before and programs.CACHE_STATS["hits"] == hits


def tasks(config, phases, depths, workload: Workload) -> list[dict]:
    """The `program_kernels` keywords of `config` at each of `depths` in each of `phases`."""
    return [
        dict(config=dataclasses.replace(config, n_layers=d), workload=workload, phase=p)
        for p in phases
        for d in depths
    ]


def work(kernels) -> dict:
    """What a program's compute kernels do, per GPU: HBM bytes, FLOPs and kernel count."""
    compute = [k for k in kernels if k.kind == "compute"]
    return {
        "hbm_bytes": sum(k.nbytes for k in compute),
        "flops": sum(k.flops for k in compute),
        "kernels": len(compute),
    }
