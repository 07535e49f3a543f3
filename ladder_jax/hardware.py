"""The GPUs ladder_jax knows, in one table: MFU (training), the memory-bandwidth roofline
(decoding) and the deviceless compile targets (`ladder_jax.overlap`) all read it.

Figures are the vendors' spec-sheet numbers per device (dense, i.e. without 2:4 sparsity):
- H100 SXM5 80GB: 989 TFLOP/s bf16, 3.35 TB/s HBM3, 80 GB (NVIDIA H100 Tensor Core GPU
  datasheet).
- H200 SXM 141GB: 989 TFLOP/s bf16, 4.8 TB/s HBM3e, 141 GB (NVIDIA H200 datasheet; same
  compute die as the H100).
- H800 SXM: H100 compute and memory with a narrower NVLink (NVIDIA H800 datasheet).
- A100 SXM4 80GB: 312 TFLOP/s bf16, 2.039 TB/s HBM2e, 80 GB (NVIDIA A100 datasheet).
- B200 (HGX B200): 2.25 PFLOP/s bf16 dense, 8 TB/s HBM3e, 180 GB (NVIDIA HGX B200 spec).
- L40S: 362 TFLOP/s bf16 dense, 864 GB/s GDDR6, 48 GB (NVIDIA L40S datasheet).

Deviceless compilation (no GPU on the machine) describes the target chip to XLA's CUDA
compiler with a `GpuTargetConfig` text proto: `gpu_target_config`. Only the sm_90 chips
(H100, H200) carry the SM figures it needs.

The performance model (`ladder_jax.predict`) reads two more tables here, its whole calibration:
`LINKS` (how long a collective takes on an interconnect) and `EFFICIENCY` (what fraction of the
spec-sheet rates kernels reach). Every figure names its public source. None is fitted to a
measured end-to-end throughput of any model.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    device_kind: str  # what the CUDA driver calls it (jax's `device.device_kind`)
    bf16_flops: float  # dense, per device
    hbm_bytes_per_s: float
    memory_bytes: int
    sm90: bool = False  # deviceless compile target (`gpu_target_config`)


CHIPS = {
    "h100": Chip("H100", "NVIDIA H100 80GB HBM3", 989e12, 3.35e12, 80 * 1024**3, sm90=True),
    "h200": Chip("H200", "NVIDIA H200", 989e12, 4.8e12, 141_000_000_000, sm90=True),
    "h800": Chip("H800", "NVIDIA H800", 989e12, 3.35e12, 80 * 1024**3),
    "a100": Chip("A100", "NVIDIA A100-SXM4-80GB", 312e12, 2.039e12, 80 * 1024**3),
    "b200": Chip("B200", "NVIDIA B200", 2250e12, 8.0e12, 180_000_000_000),
    "l40s": Chip("L40S", "NVIDIA L40S", 362e12, 0.864e12, 48_000_000_000),
}

TARGETS = tuple(k for k, c in CHIPS.items() if c.sm90)  # deviceless compile targets


def chip_of(device) -> Chip | None:
    """The table's entry for a jax device (matched on its device kind), or None."""
    kind = getattr(device, "device_kind", "") or ""
    return next((c for c in CHIPS.values() if c.name in kind), None)


# sm_90 figures (H100 and H200 share them): 132 SMs of 128 FP32 lanes, 228 KiB shared memory
# per SM (227 KiB opt-in per block), 64 Ki registers, 50 MiB L2, 1.98 GHz boost clock.
_SM90 = dict(
    threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
    shared_memory_per_core=233472, threads_per_core_limit=2048, core_count=132,
    fpus_per_core=128, block_dim_limit_x=2147483647, block_dim_limit_y=65535,
    block_dim_limit_z=65535, l2_cache_size=52428800, clock_rate_ghz=1.98,
    shared_memory_per_block_optin=232448, registers_per_core_limit=65536,
    registers_per_block_limit=65536,
)


def gpu_target_config(target: str) -> str:
    """The `GpuTargetConfig` text proto XLA compiles against for `target` (see TARGETS)."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    chip = CHIPS[target]
    fields = dict(_SM90, memory_bandwidth=int(chip.hbm_bytes_per_s),
                  device_memory_size=chip.memory_bytes)
    info = "".join(f"  {k}: {v}\n" for k, v in fields.items())
    return (f"gpu_device_info {{\n{info}  cuda_compute_capability {{ major: 9 minor: 0 }}\n}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 7 }}\n'
            f'device_description_str: "{chip.device_kind}"\n')


# ---------------------------------------------------------------------------------------------
# Calibration of the performance model (`ladder_jax.predict`).


@dataclasses.dataclass(frozen=True)
class Link:
    """A tensor-parallel interconnect as NCCL sees it: the time of a ring collective over p
    ranks moving n bytes is `base_latency_s + steps * hop_latency_s + n * f / bus_bytes_per_s`,
    with steps = 2(p-1) and f = 2(p-1)/p for an all-reduce, p-1 and (p-1)/p for an all-gather
    or reduce-scatter (n: the larger of input and output). `bus_bytes_per_s` is what
    nccl-tests prints as "busbw" for large messages; the latencies are its small-message
    times. A tree all-reduce takes 2*ceil(log2 p) steps instead of 2(p-1)."""

    name: str
    description: str
    base_latency_s: float
    hop_latency_s: float
    bus_bytes_per_s: float
    sources: str


LINKS = {
    "nvlink": Link(
        "nvlink", "H100/H200 SXM, NVLink 4 through NVSwitch (DGX/HGX H100, H200), NCCL ring",
        base_latency_s=6.6e-6, hop_latency_s=0.6e-6, bus_bytes_per_s=360e9,
        sources="latencies: NCCL's own cost model (src/graph/tuning.cc: ring/LL base latency "
                "6.6 us, 0.6 us per NVLink step); bus bandwidth: nccl-tests all_reduce_perf on "
                "8x H100 SXM (DGX H100) with the ring algorithm, ~360 GB/s busbw for large "
                "messages (NVIDIA's NVLink SHARP material reports ~480 GB/s with NVLS, which "
                "this preset does not assume); NVLink 4 is 450 GB/s per direction per GPU "
                "(H100 datasheet)"),
    "pcie": Link(
        "pcie", "PCIe Gen5 x16, NCCL peer-to-peer disabled (NCCL_P2P_DISABLE=1): every ring "
        "step goes GPU -> pinned host memory -> GPU (NCCL's SHM transport)",
        base_latency_s=6.6e-6, hop_latency_s=2.0e-6, bus_bytes_per_s=25e9,
        sources="latencies: NCCL's cost model (src/graph/tuning.cc: ring/LL base 6.6 us, "
                "1.0 us per PCI step), counted twice per step since each step crosses PCIe "
                "twice through host memory; bus bandwidth: PCIe 5.0 x16 is 63 GB/s per "
                "direction (PCI-SIG PCIe 5.0 base specification, 32 GT/s x 16 lanes, "
                "128b/130b); through host memory each byte is written to and read back from "
                "DRAM shared by all GPUs, taken as ~40% of the link rate (25 GB/s busbw), the "
                "order nccl-tests reports for P2P-disabled PCIe servers. Least certain figure "
                "of the table: measure it (see the README)"),
}


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of the spec-sheet rates, and the fixed cost of one kernel."""

    gemm: float  # of `Chip.bf16_flops`, for matmul kernels large enough to be compute bound
    memory: float  # of `Chip.hbm_bytes_per_s`, for streaming kernels
    kernel_overhead_s: float  # per kernel: launch gap in a CUDA graph plus ramp-up and tail
    sources: str


EFFICIENCY = Efficiency(
    gemm=0.70, memory=0.85, kernel_overhead_s=1.5e-6,
    sources="gemm: cuBLAS bf16 GEMMs on H100 SXM reach ~650-750 TFLOP/s of the 989 dense "
            "(NVIDIA's cuBLAS 12 / Hopper GEMM performance material); memory: streaming "
            "benchmarks (BabelStream / STREAM copy) on H100 SXM reach ~2.8-3.0 TB/s of 3.35; "
            "kernel overhead: NVIDIA's 'Getting Started with CUDA Graphs' shows ~0.5 us launch "
            "gap between short graph kernels; ~1 us more for a kernel's first DRAM access and "
            "tail on a 132-SM chip (DRAM latency ~0.6-0.8 us, H100 microbenchmark papers). "
            "Not measured on a GPU by this package")
