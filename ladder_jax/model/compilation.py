"""The XLA options every program compiles with (`compiler_options`) and `jit`, which applies them
(they keep the ladder's overlap on GPUs and `tie`'s barriers on CPU).

    step = jit(train_step, mesh=mesh, program="train", donate_argnums=(0, 1))"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

import jax
from jax.sharding import Mesh

from ladder_jax.config import UsageError

# How the GPU programs run their all-reduces (`compiler_options(..., allreduce=)`): "nccl"
# (XLA's default, NCCL's ring / tree / NVLS), "one_shot" (XLA's own one-shot / two-shot
# all-reduce kernels over NVLink peer memory where a message is small enough and every rank is
# on one host, NCCL elsewhere). The jaxlib's other all-reduce options and why they are not
# offered: docs/analysis.md, "Faster all-reduces".
ALLREDUCES = ("nccl", "one_shot")
_ALLREDUCE_OPTIONS = {
    "nccl": {},
    "one_shot": {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": True},
}


def check_allreduce(allreduce: str, flag: str = "--allreduce") -> str:
    """`allreduce` when it is one of `ALLREDUCES`, else a UsageError of one line."""
    if allreduce not in ALLREDUCES:
        raise UsageError(f"{flag} {allreduce!r}: choose one of {', '.join(ALLREDUCES)}")
    return allreduce


def compiler_options(
    platform: str, program: str = "any", allreduce: str = "nccl"
) -> dict[str, Any]:
    """XLA options ladder_jax compiles its programs with, per platform (and, on CPU, per kind
    of program: `program="train"` for training steps). One place, documented.

    GPU:
    - `xla_gpu_enable_latency_hiding_scheduler`: schedule async collectives early and their
      `done` late, around independent work (off by default in XLA:GPU).
    - `xla_gpu_all_reduce_combine_threshold_bytes=0`: never merge independent all-reduces;
      merging the ladder's psum of module i with module i+1's makes both synchronous. Cost:
      the optimizer's per-weight gradient-norm reductions (a few bytes each) stay separate.
    - `xla_gpu_experimental_parallel_collective_overlap_limit=8`: let up to eight collectives
      be in flight at once. In a training step the loss's vocab reduction is scheduled late,
      and with one slot it blocks a backward all-reduce from overlapping; under FSDP each
      module's weight all-gathers (and, in the backward, gradient reduce-scatters) run beside
      the previous module's all-reduce and take slots: with two, half of llama-3-70b's forward
      module all-reduces (8 x 8 GPUs) lost their overlap; with four, those of layers 76-78
      (the last layers' weight gathers fill the slots); with eight, all but the last.
      Decode and prefill programs hold fewer collectives at once and compile the same at 4
      and 8. The limit does not let two collectives over the same GPUs be in flight
      together: XLA:GPU's latency-hiding scheduler never schedules a collective beside an
      in-flight one sharing more than one rank with it, and a tensor-parallel step's
      all-reduces all span the same GPUs. So the ladder's decode step runs module j's
      kernels, the done of all-reduce j - 1, then the start of j (each all-reduce waits
      for the previous one to be awaited, not only to end); no option changes that order
      (`timeline.overlap_bound(..., one_in_flight=True)`; docs/analysis.md, "How much the
      ladder can hide").
    - `xla_disable_hlo_passes=GPU_KEEP_DOTS_PASS`: keep one-row matmuls (a decode step at
      batch 1: the activation is a vector) as matmul kernels. XLA:GPU rewrites such a dot
      below about 10M multiply-adds (a tp block of q/k/v/o or down, every int8 k/v) into a
      multiply and a reduce, and fuses the multiply into a kernel that writes the
      weight-sized product back to HBM for the reduce to read (an int8 weight's product in
      bf16: 4x its bytes). Kept as matmuls, a step reads each weight once
      (`ladder_jax.analysis.roofline`, docs/analysis.md#the-roofline-report).
    CPU (XLA:CPU runs collectives synchronously: CPU runs prove numerics, never overlap):
    - `xla_disable_hlo_passes=CPU_KEEP_BARRIERS_PASS`: keep `tie`'s optimization barriers
      through fusion, as XLA:GPU does. See `CPU_KEEP_BARRIERS_PASS` for why the ladder's
      backward costs quadratically in depth without it.
    - training steps only (`program="train"`): `CPU_TRAIN_OPTIONS`, XLA:CPU's library path
      that wins for them on the CPUs measured (see there). A user's own XLA_FLAGS setting of
      the same option wins over the package's.
    - `allreduce="one_shot"` (`ALLREDUCES`): `xla_gpu_unsupported_use_all_reduce_one_shot_kernel`,
      XLA's one-shot (two-shot for larger messages) all-reduce kernels; the scheduled HLO says
      which each all-reduce takes (its `kernel_strategy`). CPU programs ignore it.
    `python -m ladder_jax.overlap` compiles with exactly the GPU ones and shows the schedule.
    """
    if program not in ("any", "train"):
        raise ValueError(f"program={program!r}: choose 'any' or 'train'")
    check_allreduce(allreduce, "allreduce=")
    if platform in ("gpu", "cuda", "rocm"):
        opts = {
            "xla_gpu_enable_latency_hiding_scheduler": True,
            "xla_gpu_all_reduce_combine_threshold_bytes": 0,
            "xla_gpu_experimental_parallel_collective_overlap_limit": 8,
            "xla_disable_hlo_passes": GPU_KEEP_DOTS_PASS,
            **_ALLREDUCE_OPTIONS[allreduce],
        }
        refused = _refused_by_running_gpu(tuple(opts.items()))
        return {k: v for k, v in opts.items() if k not in refused}
    if platform == "cpu":
        opts = {"xla_disable_hlo_passes": CPU_KEEP_BARRIERS_PASS}
        if program == "train":
            flags = os.environ.get("XLA_FLAGS", "")
            opts.update({k: v for k, v in CPU_TRAIN_OPTIONS.items() if f"--{k}" not in flags})
        return opts
    return {}


@functools.lru_cache(maxsize=None)
def _refused_by_running_gpu(options: tuple) -> frozenset:
    """The options among `options` ((name, value) pairs) that the running GPU backend's XLA
    refuses ("No such compile option": a jaxlib other than the pinned one renamed or dropped
    it), each said once on stderr; empty where no GPU backend runs (a deviceless compile
    reports a refused option itself). One tiny compile per option, once per process."""
    try:
        if jax.default_backend() not in ("gpu", "cuda", "rocm"):
            return frozenset()
    except RuntimeError:
        return frozenset()
    refused = set()
    for name, value in options:
        try:
            jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(1.0).compile()
        except Exception as e:  # noqa: BLE001 - XLA raises its own error types
            if name in str(e):
                refused.add(name)
                print(
                    f"ladder_jax: this jaxlib ({jax.__version__}) has no XLA option {name}; "
                    "compiling without it (the package is tested with the pinned jax)",
                    file=sys.stderr,
                )
    return frozenset(refused)


# XLA:GPU's pass that rewrites a matmul with a vector operand into multiply + reduce when it is
# small (under 10M multiply-adds) or Triton cannot tile it (its registered name; an unknown name
# is silently ignored: tests/test_roofline.py notices, as the decode step's bytes rise).
GPU_KEEP_DOTS_PASS = "dot-strength-reduction"


# XLA:CPU's options for training steps. This jaxlib hands dots, elementwise ops and reductions
# to its YNNPACK library fusions by default; restricted to dots, with elementwise work and
# reductions left to XLA's own fused kernels, the `small` preset's training step (batch 16 x
# 128, float32, `benchmarks/cpu_flags.py`) ran 1.31-1.42x faster on a 2-core AVX-512 EPYC and
# 1.10-1.18x on a 2-core AVX2 EPYC, the best of every XLA:CPU option tried on both (the
# benchmark lists them). Decode and prefill programs keep XLA's defaults: there the prefill
# ran slower with it (104-108 -> 158-174 ms, batch 16 x 128) and the decode step the same.
CPU_TRAIN_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


# XLA:CPU's pass that strips optimization barriers early in its pipeline, before fusion (its
# registered name; an unknown name is silently ignored, tests/test_cpu_program.py notices).
#
# Why the ladder needs the barriers kept on CPU. The ladder's backward carries a running sum
# of stream cotangents: c_k = c_{k+1} + n_k, n_k being module k's norm input cotangent, and
# module k-2 reads c_k. Since each module reads the stream without its predecessor's output,
# n_k comes (through module k's matmuls) from c_{k+2}, not from c_{k+1}: c_k is linked to
# c_{k+1} by an addition only. XLA's fusion duplicates a multi-user producer into its
# consumers whenever it can fuse it into every one of them along every path; the additions and
# the bitcasts/transposes feeding the next matmuls all fuse, so no c is materialized and every
# consumer fusion recomputes the whole chain above it, RMSNorm backwards included: quadratic in
# depth, 2-2.7x standard's step time at 8 layers. (In standard, n_k comes from c_{k+1} through
# matmuls, which fusion cannot cross, so each c is computed once.) The ladder's backward already
# has such a path: it ties module k+1's in-flight cotangent to module k's matmul output (which
# comes from c_{k+2}) before n_{k+1} joins the sum. XLA:GPU keeps that barrier through fusion;
# XLA:CPU strips it first, and the path with it. Keeping it restores the path, and each c is
# materialized once. Exact: barriers are identities and the arithmetic is unchanged, only
# fusion boundaries move (gradients came out bit-identical at tp 1 and 2).
CPU_KEEP_BARRIERS_PASS = "cse_barrier_expander"


def jit(
    fn: Callable,
    *,
    platform: str | None = None,
    mesh: Mesh | None = None,
    program: str = "any",
    allreduce: str | None = None,
    **jit_kwargs,
) -> Callable:
    """`jax.jit` with ladder_jax's compiler options for `platform`: given, else that of `mesh`'s
    devices (a deviceless GPU mesh on a CPU host compiles for the GPU), else the backend's;
    `program="train"` for a training step; `allreduce` (None: the process's, `use_allreduce`)
    (`compiler_options`)."""
    if platform is None and mesh is not None:
        platform = mesh.devices.flat[0].platform
    platform = platform or jax.default_backend()
    allreduce = allreduce or _PROCESS["allreduce"]
    opts = (
        compiler_options(platform, program)
        if allreduce == "nccl"
        else compiler_options(platform, program, allreduce)
    )
    if opts:
        jit_kwargs.setdefault("compiler_options", opts)
    return jax.jit(fn, **jit_kwargs)


_PROCESS = {"allreduce": "nccl"}


def use_allreduce(allreduce: str) -> None:
    """The all-reduce implementation every later `jit` of this process compiles GPU programs
    with (`ALLREDUCES`; the `decode` and `serve` commands' `--allreduce`). CPU programs ignore
    it (XLA:CPU has one all-reduce), so CPU runs are unchanged."""
    _PROCESS["allreduce"] = check_allreduce(allreduce)
