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
