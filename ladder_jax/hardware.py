"""The GPUs ladder_jax knows, in one table read by MFU, the decode roofline, the deviceless
compile targets (`TARGETS`) and the performance model; each constant names its public source
(hardware_sources.json), none is fitted to a measured throughput (docs/analysis.md, 'Calibration').

    cal = calibration("h100")          # or Calibration.load("gpu.json") from calibrate_gpu.py"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from importlib import resources

# Each constant's public sources (`sources=`), one entry per constant, read at import.
SOURCES: dict[str, str] = json.loads(
    resources.files("ladder_jax").joinpath("hardware_sources.json").read_text(encoding="utf-8")
)


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    device_kind: str  # what the CUDA driver calls it (jax's `device.device_kind`)
    bf16_flops: float  # dense, per device
    hbm_bytes_per_s: float
    memory_bytes: int
    arch: str | None = None  # deviceless compile target (`gpu_target_config`): sm90, sm80
    sms: int = 132  # streaming multiprocessors (what NCCL's channels take a share of)


# The two A100 SXM4 parts differ in their HBM only (A100 datasheet: 80 GB HBM2e at 2,039 GB/s,
# 40 GB HBM2 at 1,555 GB/s; the same 108 SMs, 40 MB L2 and NVLink 3): "a100" is the 80 GB one.
CHIPS = {
    "h100": Chip("H100", "NVIDIA H100 80GB HBM3", 989e12, 3.35e12, 80 * 1024**3, arch="sm90"),
    "h200": Chip("H200", "NVIDIA H200", 989e12, 4.8e12, 141_000_000_000, arch="sm90"),
    "h800": Chip("H800", "NVIDIA H800", 989e12, 3.35e12, 80 * 1024**3),
    "a100": Chip(
        "A100", "NVIDIA A100-SXM4-80GB", 312e12, 2.039e12, 80 * 1024**3, arch="sm80", sms=108
    ),
    "a100-40gb": Chip(
        "A100 40GB", "NVIDIA A100-SXM4-40GB", 312e12, 1.555e12, 40 * 1024**3, arch="sm80", sms=108
    ),
    "b200": Chip("B200", "NVIDIA B200", 2250e12, 8.0e12, 180_000_000_000),
    "l40s": Chip("L40S", "NVIDIA L40S", 362e12, 0.864e12, 48_000_000_000),
}

TARGETS = tuple(k for k, c in CHIPS.items() if c.arch)  # deviceless compile targets


def chip_of(device) -> Chip | None:
    """The table's entry for a jax device: the one of its exact device kind, else the first
    whose name the kind contains (an A100-SXM4-40GB is not an 80 GB part), else None."""
    kind = getattr(device, "device_kind", "") or ""
    exact = next((c for c in CHIPS.values() if c.device_kind == kind), None)
    return exact or next((c for c in CHIPS.values() if c.name in kind), None)


# sm_90 figures (H100 and H200 share them): 132 SMs of 128 FP32 lanes, 228 KiB shared memory
# per SM (227 KiB opt-in per block), 64 Ki registers, 50 MiB L2, 1.98 GHz boost clock.
# sm_80 (A100 SXM4): 108 SMs of 64 FP32 lanes, 164 KiB shared memory per SM (163 KiB opt-in per
# block), 64 Ki registers, 40 MiB L2, 1.41 GHz boost clock (Ampere whitepaper, CUDA
# programming guide's compute capability 8.0 table).
_ARCH = {
    "sm90": dict(
        threads_per_block_limit=1024,
        threads_per_warp=32,
        shared_memory_per_block=49152,
        shared_memory_per_core=233472,
        threads_per_core_limit=2048,
        core_count=132,
        fpus_per_core=128,
        block_dim_limit_x=2147483647,
        block_dim_limit_y=65535,
        block_dim_limit_z=65535,
        l2_cache_size=52428800,
        clock_rate_ghz=1.98,
        shared_memory_per_block_optin=232448,
        registers_per_core_limit=65536,
        registers_per_block_limit=65536,
    ),
    "sm80": dict(
        threads_per_block_limit=1024,
        threads_per_warp=32,
        shared_memory_per_block=49152,
        shared_memory_per_core=167936,
        threads_per_core_limit=2048,
        core_count=108,
        fpus_per_core=64,
        block_dim_limit_x=2147483647,
        block_dim_limit_y=65535,
        block_dim_limit_z=65535,
        l2_cache_size=41943040,
        clock_rate_ghz=1.41,
        shared_memory_per_block_optin=166912,
        registers_per_core_limit=65536,
        registers_per_block_limit=65536,
    ),
}
_CAPABILITY = {"sm90": (9, 0), "sm80": (8, 0)}


def cpu_description() -> str:
    """This host's CPU as benchmarks print it: model, cores and the vector extensions that
    decide matmul speed (CPU figures of two machines compare only with these beside them)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    isa = [
        x
        for x in (
            "avx2",
            "fma",
            "avx512f",
            "avx512bw",
            "avx512_bf16",
            "avx512_vnni",
            "amx_bf16",
            "amx_tile",
        )
        if x in flags
    ]
    return f"{model}, {os.cpu_count()} cores, {' '.join(isa) or 'no AVX2 / AVX-512 flags seen'}"


def gpu_target_config(target: str) -> str:
    """The `GpuTargetConfig` text proto XLA compiles against for `target` (see TARGETS)."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    chip = CHIPS[target]
    fields = dict(
        _ARCH[chip.arch],
        memory_bandwidth=int(chip.hbm_bytes_per_s),
        device_memory_size=chip.memory_bytes,
    )
    info = "".join(f"  {k}: {v}\n" for k, v in fields.items())
    major, minor = _CAPABILITY[chip.arch]
    return (
        f"gpu_device_info {{\n{info}  cuda_compute_capability {{ major: {major} minor: "
        f"{minor} }}\n}}\n"
        f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 7 }}\n'
        f'device_description_str: "{chip.device_kind}"\n'
    )


# ---------------------------------------------------------------------------------------------
# Calibration of the performance model (`ladder_jax.predict`).


@dataclasses.dataclass(frozen=True)
class Link:
    """An interconnect as NCCL sees it: the time of a ring collective over p ranks moving n
    bytes is `base_latency_s + steps * hop_latency_s + n * f / bus_bytes_per_s`, with
    steps = 2(p-1) and f = 2(p-1)/p for an all-reduce, p-1 and (p-1)/p for an all-gather or
    reduce-scatter (n: the larger of input and output). `bus_bytes_per_s` is what nccl-tests
    prints as "busbw" for large messages; the latencies are its small-message times. A tree
    all-reduce takes 2*ceil(log2 p) steps instead of 2(p-1). `channels`: how many NCCL
    channels (one thread block, i.e. one SM, each) a large collective runs on
    (`Contention`). An inter-host link's figures are per GPU (one NIC each). `hw`: the class
    of link in NCCL's tables (`NcclTuning`). `nic_path`: for an inter-host link, the type of
    the PCIe path from a GPU to its NIC in NCCL's topology (`NCCL_PATHS`; PIX: the NIC on the
    GPU's own PCIe switch, as in DGX/HGX systems), which decides whether NCCL runs LL128
    across hosts (`collectives.ll128_enabled`)."""

    name: str
    description: str
    base_latency_s: float
    hop_latency_s: float
    bus_bytes_per_s: float
    sources: str
    channels: int = 24
    hw: str = "nvlink"  # NCCL's class of the link: nvlink, pci (P2P off: through host memory), net
    nic_path: str = "PIX"  # inter-host links: the GPU -> NIC path type (`NCCL_PATHS`)


# NCCL's path types from nearest to farthest (src/graph/topo.h of NVIDIA/nccl, 2.2x: local,
# NVLink, NVLink through a GPU, chip-to-chip, one PCIe switch, several PCIe switches, C2C to the
# CPU then PCIe, through another GPU's NIC (PXN), the PCIe host bridge, across CPU sockets,
# the network, disconnected); NCCL enables a feature when a path is at most some type.
NCCL_PATHS = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS", "NET", "DIS")


LINKS = {
    "nvlink": Link(
        "nvlink",
        "H100/H200 SXM, NVLink 4 through NVSwitch (DGX/HGX H100, H200), NCCL ring",
        base_latency_s=6.6e-6,
        hop_latency_s=0.6e-6,
        bus_bytes_per_s=360e9,
        channels=24,
        sources=SOURCES["LINKS.nvlink"],
    ),
    "pcie": Link(
        "pcie",
        "PCIe Gen5 x16, NCCL peer-to-peer disabled (NCCL_P2P_DISABLE=1): every ring "
        "step goes GPU -> pinned host memory -> GPU (NCCL's SHM transport)",
        base_latency_s=6.6e-6,
        hop_latency_s=2.0e-6,
        bus_bytes_per_s=25e9,
        channels=4,
        hw="pci",
        sources=SOURCES["LINKS.pcie"],
    ),
}
# channels: NCCL prints "N coll channels" at start-up; on NVSwitch machines (DGX H100, DGX
# A100) its ring runs on 24 or more channels, over PCIe / host memory on a few (2-4).

A100_LINKS = {  # the same two interconnects one generation earlier
    "nvlink": Link(
        "nvlink",
        "A100 SXM4, NVLink 3 through NVSwitch (DGX/HGX A100), NCCL ring",
        base_latency_s=6.6e-6,
        hop_latency_s=0.6e-6,
        bus_bytes_per_s=230e9,
        channels=24,
        sources=SOURCES["A100_LINKS.nvlink"],
    ),
    "pcie": Link(
        "pcie",
        "PCIe Gen4 x16, NCCL peer-to-peer disabled (NCCL_P2P_DISABLE=1): every ring "
        "step goes GPU -> pinned host memory -> GPU (NCCL's SHM transport)",
        base_latency_s=6.6e-6,
        hop_latency_s=2.0e-6,
        bus_bytes_per_s=12.5e9,
        channels=4,
        hw="pci",
        sources=SOURCES["A100_LINKS.pcie"],
    ),
}

INTER_HOST = {  # one NIC per GPU (rail-optimized DGX/HGX clusters); figures per GPU
    "h100": Link(
        "ib-ndr",
        "InfiniBand NDR 400 Gb/s, one ConnectX-7 NIC per GPU (DGX/HGX H100 "
        "clusters), GPUDirect RDMA",
        base_latency_s=6.6e-6,
        hop_latency_s=2.7e-6,
        bus_bytes_per_s=45e9,
        channels=16,
        hw="net",
        sources=SOURCES["INTER_HOST.h100"],
    ),
    "a100": Link(
        "ib-hdr",
        "InfiniBand HDR 200 Gb/s, one ConnectX-6 NIC per GPU (DGX/HGX A100 "
        "clusters), GPUDirect RDMA",
        base_latency_s=6.6e-6,
        hop_latency_s=2.7e-6,
        bus_bytes_per_s=22.5e9,
        channels=16,
        hw="net",
        sources=SOURCES["INTER_HOST.a100"],
    ),
}


@dataclasses.dataclass(frozen=True)
class NcclTuning:
    """NCCL's own cost model, with which it picks an algorithm (ring, tree) and a protocol
    (LL, LL128, Simple) for each collective by message size and topology: every pair's time
    is `latency + bytes / bandwidth` and the fastest runs. `collectives.nccl_seconds` applies it
    to tp groups that span hosts (`--algorithm nccl`, the default). Latencies are NCCL's
    figures for its reference hardware; a link's own `hop_latency_s` (its ring/LL step)
    rescales those of its class, so a calibrated link moves all three protocols."""

    base_latency_s: dict  # (algorithm, protocol) -> seconds per collective
    step_latency_s: dict  # (link class, algorithm, protocol) -> seconds per step
    net_overhead_s: float  # the proxy's post per ring step across hosts (three for Simple)
    ll_bus_bytes_per_s: dict  # hosts (2, or 3 for more) -> LL's bus bandwidth cap
    protocol_share: dict  # (algorithm, protocol) -> share of the link's bus bandwidth
    ring_plateau: float  # Simple ring latency factor across hosts beyond 64 B per channel-rank
    sources: str
    # within one host (`collectives.nccl_one_host_seconds`)
    ll_one_host_bus_bytes_per_s: dict = dataclasses.field(default_factory=dict)  # arch -> cap
    tree_ll128_one_host_share: float = 0.92 * 7 / 9
    nvls_archs: tuple = ()  # archs with NVLink SHARP (NVSwitch multicast/reduce)
    nvls_latency_s: float = 0.0
    nvls_channels: int = 16
    nvls_bus_factor: dict = dataclasses.field(default_factory=dict)  # ranks -> x ring busbw
    # LL128 (`collectives.ll128_enabled`): the archs NCCL enables it on, the farthest GPU -> NIC
    # path across hosts (`NCCL_PATHS`), and the archs allowed PXN beyond it
    ll128_archs: tuple = ("sm70", "sm80", "sm90", "sm100", "sm120")
    ll128_nic_path: str = "PXB"
    ll128_pxn_archs: tuple = ("sm90", "sm100", "sm120")


PROTOCOLS = ("LL", "LL128", "Simple")


def _table(**rows) -> dict:
    return {(*k.split("_"), p): v * 1e-6 for k, vs in rows.items() for p, v in zip(PROTOCOLS, vs)}


NCCL = NcclTuning(
    base_latency_s=_table(tree=(6.8, 14.0, 8.4), ring=(6.6, 14.0, 8.4)),
    step_latency_s=_table(
        nvlink_tree=(0.6, 1.25, 4.0),
        nvlink_ring=(0.6, 1.9, 3.4),
        pci_tree=(1.0, 1.9, 4.0),
        pci_ring=(1.0, 2.5, 5.7),
        net_tree=(5.0, 8.5, 14.0),
        net_ring=(2.7, 4.0, 14.0),
    ),
    net_overhead_s=1.0e-6,
    ll_bus_bytes_per_s={2: 39.0e9, 3: 20.4e9},
    protocol_share={
        ("ring", "LL"): 0.5,
        ("ring", "LL128"): 0.92,
        ("ring", "Simple"): 1.0,
        ("tree", "LL"): 0.92 / 3.8,
        ("tree", "LL128"): 0.92 * 120 / 128,
        ("tree", "Simple"): 0.92,
    },
    ring_plateau=1.4,
    ll_one_host_bus_bytes_per_s={"sm80": 87.7e9, "sm90": 141.0e9},
    tree_ll128_one_host_share=0.92 * 7 / 9,
    nvls_archs=("sm90",),
    nvls_latency_s=25e-6,
    nvls_channels=16,
    nvls_bus_factor={r: gbs / 370 for r, gbs in enumerate((370, 370, 370, 420, 440, 460, 480), 2)},
    sources=SOURCES["NCCL"],
)


@dataclasses.dataclass(frozen=True)
class Contention:
    """What a collective in flight takes from the kernels beside it (the two-stream replay in
    `ladder_jax.analysis.perfmodel`). NCCL runs each channel as one thread block resident on
    one SM for the collective's whole duration, so a kernel beside it has
    `1 - channels / chip.sms` of the SMs: its FLOP rate drops by that share. NCCL picks fewer
    channels for small messages (it drops channels until each thread has enough bytes): here
    one channel per `bytes_per_channel` of message, up to the link's `channels`. Its copies
    also move HBM bytes: `hbm_bytes_per_bus_byte` for each byte it sends, at the rate it
    sends them, taken from the kernel's HBM bandwidth. The contention goes both ways: while a
    kernel runs beside it, a collective moves its data at `copy_rate` of its own speed (its
    latency is not slowed): its copies share the memory system and the SMs' issue with the
    kernel."""

    bytes_per_channel: float
    hbm_bytes_per_bus_byte: float
    sources: str
    copy_rate: float = 0.5


CONTENTION = Contention(
    bytes_per_channel=64 * 1024,
    hbm_bytes_per_bus_byte=3.0,
    sources=SOURCES["CONTENTION"],
)


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of the spec-sheet rates, and the fixed cost of one kernel."""

    gemm: float  # of `Chip.bf16_flops`, for matmul kernels large enough to be compute bound
    memory: float  # of `Chip.hbm_bytes_per_s`, for streaming kernels
    kernel_overhead_s: float  # per kernel: launch gap in a CUDA graph plus ramp-up and tail
    sources: str


EFFICIENCY = Efficiency(
    gemm=0.70,
    memory=0.85,
    kernel_overhead_s=1.5e-6,
    sources=SOURCES["EFFICIENCY"],
)


A100_EFFICIENCY = Efficiency(
    gemm=0.80,
    memory=0.85,
    kernel_overhead_s=1.5e-6,
    sources=SOURCES["A100_EFFICIENCY"],
)


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the host spends issuing a program's work, and the GPU waits for when the host is
    the slower of the two (many short kernels: small models at high tp). XLA runs runs of at
    least `min_graph` consecutive kernels between collectives as one command buffer (a CUDA
    graph: one `graph_s` launch; XLA's default set holds fusions, cuBLAS and custom calls, not
    collectives); every other kernel costs `kernel_s` of host time and `stream_gap_s` more
    device time than a graph node; each collective costs `collective_s` (NCCL's enqueue and
    launch). `step_s` is one call of the jitted program (jax's dispatch), overlapped with the
    previous step's GPU work, so a step lasts at least the host's whole share. An asynchronous
    collective runs on a stream of its own: it starts `stream_sync_s` after the kernel that
    made its input ends (the collective stream waits on the compute stream's event), and the
    kernel that waits for it starts `stream_sync_s` after it ends; a blocking collective runs
    on the compute stream and pays neither."""

    kernel_s: float
    graph_s: float
    stream_gap_s: float
    collective_s: float
    step_s: float
    min_graph: int
    sources: str
    stream_sync_s: float = 0.0


LAUNCH = Launch(
    kernel_s=2.7e-6,
    graph_s=2.7e-6,
    stream_gap_s=0.4e-6,
    collective_s=3.5e-6,
    step_s=29e-6,
    min_graph=5,
    stream_sync_s=2e-6,
    sources=SOURCES["LAUNCH"],
)


@dataclasses.dataclass(frozen=True)
class AllReduceKernel:
    """XLA's own all-reduce kernel over NVLink peer memory (`--allreduce one_shot`; the
    compiled HLO names the strategy of each all-reduce): one_shot, every rank reads the n - 1
    other ranks' buffers and reduces, `base_s + (n - 1) * bytes / link_bytes_per_s`; two_shot,
    a reduce-scatter then an all-gather, `base_s + 2 * (n - 1) / n * bytes / link_bytes_per_s`.
    `base_s`: the kernel's launch and its cross-GPU barriers. Within one host over NVLink only
    (peer access); elsewhere the program's all-reduce runs on NCCL and is costed as NCCL."""

    name: str
    base_s: float
    link_bytes_per_s: float
    sources: str


ALLREDUCE_KERNELS = {  # by chip generation (`_GENERATION`), then strategy
    "h100": {
        "one_shot": AllReduceKernel(
            "one_shot", 2.5e-6, 18 * 20e9, SOURCES["ALLREDUCE_KERNELS.h100.one_shot"]
        ),
        "two_shot": AllReduceKernel(
            "two_shot", 4.0e-6, 18 * 20e9, SOURCES["ALLREDUCE_KERNELS.h100.two_shot"]
        ),
    },
    "a100": {
        "one_shot": AllReduceKernel(
            "one_shot", 2.5e-6, 12 * 20e9, SOURCES["ALLREDUCE_KERNELS.a100.one_shot"]
        ),
        "two_shot": AllReduceKernel(
            "two_shot", 4.0e-6, 12 * 20e9, SOURCES["ALLREDUCE_KERNELS.a100.two_shot"]
        ),
    },
}


LAUNCH_MODES = ("graphs", "streams", "off")  # command buffers (XLA's default), none, ablation

# which link tables and efficiencies a chip uses
_GENERATION = {"h100": "h100", "h200": "h100", "a100": "a100", "a100-40gb": "a100"}


def links(target: str) -> dict[str, Link]:
    """The intra-host links of `target`'s generation (same names: nvlink, pcie)."""
    return A100_LINKS if _GENERATION.get(target) == "a100" else LINKS


def efficiency(target: str) -> Efficiency:
    return A100_EFFICIENCY if _GENERATION.get(target) == "a100" else EFFICIENCY


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Everything the performance model costs a program with, for one target: `calibration`
    gives the public figures above; `Calibration.load` reads a file that
    `benchmarks/calibrate_gpu.py` wrote on a real GPU (JSON: any of the sections `chip`,
    `efficiency`, `links`, `inter_host`, `contention`, `launch`, each a dict of the fields it
    replaces; other top-level keys, such as `measured`, are kept for the reader and ignored
    here)."""

    target: str
    chip: Chip
    efficiency: Efficiency
    links: dict
    inter_host: Link
    contention: Contention
    source: str = "hardware.py (public figures)"
    nccl: NcclTuning = NCCL
    launch: Launch = LAUNCH
    allreduce_kernels: dict = dataclasses.field(
        default_factory=lambda: dict(ALLREDUCE_KERNELS["h100"])
    )

    def replace(self, **sections) -> Calibration:
        """A copy with `chip`, `efficiency`, `inter_host`, `contention`, `launch` fields replaced
        (a dict each) and `links` (a dict of dicts, per link name; `"*"` for every link)."""
        kw = {}
        for name in ("chip", "efficiency", "inter_host", "contention", "launch"):
            if sections.get(name):
                kw[name] = _replaced(getattr(self, name), sections[name], name)
        if sections.get("links"):
            table = dict(self.links)
            for lname, fields in sections["links"].items():
                names = list(table) if lname == "*" else [lname]
                for n in names:
                    if n not in table:
                        raise ValueError(
                            f"links: unknown link {n!r}: choose one of {', '.join(table)}"
                        )
                    table[n] = _replaced(table[n], fields, f"links.{n}")
            kw["links"] = table
        return dataclasses.replace(self, **kw)

    @classmethod
    def load(cls, path: str, target: str | None = None) -> Calibration:
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"--hardware {path}: cannot read it ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--hardware {path}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"--hardware {path}: expected a JSON object")
        if target and data.get("target") not in (None, target):
            raise ValueError(
                f"--hardware {path}: its figures are for {data['target']!r}; pass "
                f"--target {data['target']}"
            )
        target = target or data.get("target", "h100")
        try:
            return dataclasses.replace(
                calibration(target).replace(
                    **{
                        k: data.get(k)
                        for k in (
                            "chip",
                            "efficiency",
                            "links",
                            "inter_host",
                            "contention",
                            "launch",
                        )
                    }
                ),
                source=path,
            )
        except ValueError as e:
            raise ValueError(f"--hardware {path}: {e}") from None


def _replaced(obj, fields, where: str):
    if not isinstance(fields, dict):
        raise ValueError(f"{where} must be an object of fields")
    known = {f.name: f for f in dataclasses.fields(obj)}
    for k, v in fields.items():
        if k not in known or k in ("name", "device_kind", "arch", "hw"):
            raise ValueError(f"{where}: unknown field {k!r}")
        if k in ("description", "sources"):
            continue
        if k == "nic_path":
            if v not in NCCL_PATHS:
                raise ValueError(f"{where}.nic_path={v!r}: choose one of {', '.join(NCCL_PATHS)}")
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}.{k}={v!r} must be a finite number >= 0")
    return dataclasses.replace(obj, **fields)


def calibration(target: str) -> Calibration:
    """The public figures of `target` (see the module doc)."""
    if target not in CHIPS:
        raise ValueError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    gen = _GENERATION.get(target, "h100")
    return Calibration(
        target,
        CHIPS[target],
        efficiency(target),
        dict(links(target)),
        INTER_HOST[gen],
        CONTENTION,
        allreduce_kernels=dict(ALLREDUCE_KERNELS[gen]),
    )
