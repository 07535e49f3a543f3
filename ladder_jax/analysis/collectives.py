"""Timing one collective as NCCL runs it, within a host (NVLink, PCIe, NVLS) and across hosts,
from the public figures of `ladder_jax.hardware` (`NcclTuning`, `Link`). The model, term by
term: docs/analysis.md, 'Collectives across hosts', 'Collectives within a host'.

    seconds, latency, pick = time_collective(kernel, link=cal.links["nvlink"], calibration=cal)"""

from __future__ import annotations

import dataclasses
import math

from ladder_jax import hardware
from ladder_jax.analysis.kernels import Kernel, PredictError

ALGORITHMS = ("nccl", "ring", "tree")  # how collectives are timed (`costed`)


def _ring(collective: str, ranks: int, algorithm: str) -> tuple[int, float]:
    """(latency steps, bytes on the bus per byte of message) of a one-level collective."""
    if ranks <= 1:
        return 0, 0.0
    if collective == "all-reduce":
        steps = 2 * math.ceil(math.log2(ranks)) if algorithm == "tree" else 2 * (ranks - 1)
        return steps, 2 * (ranks - 1) / ranks
    if collective in ("all-gather", "reduce-scatter"):
        return ranks - 1, (ranks - 1) / ranks
    return 1, 1.0


def collective_seconds(
    collective: str,
    nbytes: float,
    ranks: int,
    link: hardware.Link,
    algorithm: str = "ring",
    *,
    hosts: int = 1,
    inter_host: hardware.Link | None = None,
) -> float:
    """NCCL-style time of one collective of `nbytes` over `ranks` GPUs: a ring (or tree) on
    `link` within one host; across `hosts` hosts, hierarchical (module doc, step 4): g =
    ranks / hosts GPUs per host on `link`, the hosts joined by `inter_host` (per GPU)."""
    if ranks <= 1:
        return 0.0
    if hosts <= 1:
        steps, traffic = _ring(collective, ranks, algorithm)
        return (
            link.base_latency_s
            + steps * link.hop_latency_s
            + nbytes * traffic / (link.bus_bytes_per_s)
        )
    if inter_host is None:
        raise PredictError("a collective across hosts needs an inter-host link")
    g = ranks // hosts
    intra_steps, intra = _ring(collective, g, algorithm)
    inter_steps, inter = _ring(collective, hosts, algorithm)
    return (
        link.base_latency_s
        + intra_steps * link.hop_latency_s
        + inter_steps * inter_host.hop_latency_s
        + max(
            nbytes * intra / link.bus_bytes_per_s, nbytes / g * inter / inter_host.bus_bytes_per_s
        )
    )


def nccl_seconds(
    collective: str,
    nbytes: float,
    ranks: int,
    link: hardware.Link,
    *,
    hosts: int,
    inter_host: hardware.Link,
    tuning: hardware.NcclTuning = hardware.NCCL,
    arch: str | None = None,
) -> tuple[float, str]:
    """(seconds, "algorithm/protocol") of one collective over `ranks` GPUs on `hosts` > 1 hosts as
    NCCL's cost model (`hardware.NcclTuning`) times and picks it: ring or (all-reduce) tree,
    each in LL, Simple and, where NCCL enables it on `arch` (`ll128_enabled`), LL128; the
    fastest. The bandwidth term is the hierarchy's (`collective_seconds`) divided by the
    protocol's share of the bus; a tree moves 2n bytes per rank. Step latencies are NCCL's for
    the link's class, rescaled by the link's own ring/LL step (`hop_latency_s`); a ring step
    within a host waits at least the network overhead, since every step of a ring that crosses
    hosts goes through the proxy."""
    g = ranks // hosts
    ring_bw = collective_seconds(
        collective,
        nbytes,
        ranks,
        dataclasses.replace(link, base_latency_s=0, hop_latency_s=0),
        hosts=hosts,
        inter_host=dataclasses.replace(inter_host, base_latency_s=0, hop_latency_s=0),
    )
    steps, traffic = _ring(collective, ranks, "ring")
    inter_steps = _ring(collective, hosts, "ring")[0]
    base, step, share = tuning.base_latency_s, tuning.step_latency_s, tuning.protocol_share

    def lat(which: hardware.Link, algo: str, proto: str) -> float:
        ll = step[(which.hw, "ring", "LL")]
        return step[(which.hw, algo, proto)] * (which.hop_latency_s / ll if ll else 1.0)

    ll_cap = tuning.ll_bus_bytes_per_s[min(hosts, 3)]
    ll128 = ll128_enabled(link, arch, inter_host, tuning)
    options = []
    for proto in ("LL", "LL128", "Simple"):
        if proto == "LL128" and not ll128:
            continue
        intra = max(
            lat(link, "ring", proto), tuning.net_overhead_s * (3 if proto == "Simple" else 1)
        )
        inter = lat(inter_host, "tree" if g == 1 else "ring", proto)
        latency = base[("ring", proto)] + (steps - inter_steps) * intra + inter_steps * inter
        if (
            proto == "Simple"
            and collective == "all-reduce"
            and nbytes / (inter_host.channels * ranks) >= 64
        ):
            latency *= tuning.ring_plateau
        moved = ring_bw / share[("ring", proto)]
        if proto == "LL":
            moved = max(moved, nbytes * traffic / ll_cap)
        options.append((latency + moved, f"ring/{proto}"))
        if collective == "all-reduce":
            latency = base[("tree", proto)] + 2 * (
                (g - 1) * lat(link, "tree", proto)
                + math.ceil(math.log2(hosts)) * lat(inter_host, "tree", proto)
            )
            moved = ring_bw * (2 / traffic) / share[("tree", proto)]
            if proto == "LL":
                moved = max(moved, 2 * nbytes / ll_cap)
            options.append((latency + moved, f"tree/{proto}"))
    return min(options)


def ll128_enabled(
    link: hardware.Link,
    arch: str | None = None,
    inter_host: hardware.Link | None = None,
    tuning: hardware.NcclTuning = hardware.NCCL,
) -> bool:
    """Whether NCCL enables its LL128 protocol for a ring over `link` within each host (and
    across hosts over `inter_host`, None within one host), as its tuning code decides by
    default (`hardware.NcclTuning`): only where the intra-host path is NVLink (never with P2P
    off: `link.hw` "pci" goes through host memory), only on the archs NCCL has validated it on
    (None: not known, not restricted), and across hosts only when the GPU -> NIC path
    (`inter_host.nic_path`) is at most `tuning.ll128_nic_path` (PXB), or PXN on the archs of
    `tuning.ll128_pxn_archs`.

        ll128_enabled(LINKS["nvlink"], "sm90", dataclasses.replace(ib, nic_path="PHB"))  # False
    """
    if link.hw != "nvlink":
        return False
    if arch is not None and arch not in tuning.ll128_archs:
        return False
    if inter_host is None:
        return True
    paths = hardware.NCCL_PATHS
    rank = paths.index(inter_host.nic_path)
    if rank <= paths.index(tuning.ll128_nic_path):
        return True
    return arch in tuning.ll128_pxn_archs and rank <= paths.index("PXN")


def nccl_one_host_seconds(
    collective: str,
    nbytes: float,
    ranks: int,
    link: hardware.Link,
    *,
    arch: str | None = None,
    tuning: hardware.NcclTuning = hardware.NCCL,
    nvls: bool = True,
) -> tuple[float, str]:
    """(seconds, "algorithm/protocol") of one collective over `ranks` GPUs of one host: the
    fastest of NCCL's ring and (all-reduce) tree in LL, LL128 and Simple, with NCCL's
    latencies for the link's class (base and step rescaled by the link's own ring/LL figures,
    so the ring/LL option is `collective_seconds`'s ring at LL's bandwidth), and NVLS for an
    all-reduce on an `arch` with NVLink SHARP at its measured bandwidth (`hardware.NCCL`).
    Each option is affine in `nbytes` and slower on a slower link, and so is their minimum.

        s, how = nccl_one_host_seconds("all-reduce", 16384, 8, LINKS["nvlink"], arch="sm90")
    """
    s, _, how = _one_host_pick(collective, nbytes, ranks, link, arch, tuning, nvls)
    return s, how


def _one_host_pick(collective, nbytes, ranks, link, arch, tuning, nvls) -> tuple:
    """(seconds, of them latency, name) of the fastest option (`nccl_one_host_seconds`)."""
    if ranks <= 1:
        return 0.0, 0.0, "none"
    steps, traffic = _ring(collective, ranks, "ring")
    base, step, share = tuning.base_latency_s, tuning.step_latency_s, tuning.protocol_share
    hop = link.hop_latency_s / step[(link.hw, "ring", "LL")]
    at = link.base_latency_s / base[("ring", "LL")]
    ll_cap = tuning.ll_one_host_bus_bytes_per_s.get(arch, math.inf)
    options = []  # (latency, bus bandwidth, bytes on the bus, name)
    for proto in hardware.PROTOCOLS:
        if proto == "LL128" and not ll128_enabled(link, arch, None, tuning):
            continue
        cap = ll_cap if proto == "LL" else math.inf
        options.append(
            (
                base[("ring", proto)] * at + steps * step[(link.hw, "ring", proto)] * hop,
                min(link.bus_bytes_per_s * share[("ring", proto)], cap),
                traffic,
                f"ring/{proto}",
            )
        )
        if collective == "all-reduce":
            tree = tuning.tree_ll128_one_host_share if proto == "LL128" else share[("tree", proto)]
            options.append(
                (
                    base[("tree", proto)] * at
                    + 2 * (ranks - 1) * step[(link.hw, "tree", proto)] * hop,
                    min(link.bus_bytes_per_s * tree, cap),
                    2.0,
                    f"tree/{proto}",
                )
            )
    if nvls and collective == "all-reduce" and link.hw == "nvlink" and arch in tuning.nvls_archs:
        factor = tuning.nvls_bus_factor.get(min(ranks, max(tuning.nvls_bus_factor)), 1.0)
        options.append(
            (tuning.nvls_latency_s * hop, link.bus_bytes_per_s * factor, traffic, "nvls/Simple")
        )
    return min((lat + nbytes * moved / bw, lat, name) for lat, bw, moved, name in options)


def bus_bytes(collective: str, nbytes: float, ranks: int, algorithm: str = "ring") -> float:
    """Bytes one GPU sends for a collective (what its copies move)."""
    return nbytes * _ring(collective, ranks, algorithm)[1]


def time_collective(
    k: Kernel,
    *,
    link: hardware.Link,
    calibration: hardware.Calibration,
    algorithm: str = "nccl",
    in_host: bool = True,
    nvls: bool = True,
) -> tuple[float, float, str]:
    """Seconds of collective kernel `k`, its latency (the seconds of an empty message) and
    NCCL's pick ("algorithm/protocol", or "" where none was made). An all-reduce the program
    runs on XLA's own kernel (`Kernel.strategy`: one_shot, two_shot) is timed as that kernel
    (`allreduce_kernel_seconds`) within one host over NVLink; elsewhere (P2P off, across hosts)
    the kernel cannot reach its peers' memory and it is timed as NCCL. With algorithm "nccl" as
    NCCL picks it across hosts (`nccl_seconds`) and, with `in_host`, within one
    (`nccl_one_host_seconds`, NVLS with `nvls`; without `in_host` a ring at LL's latency);
    "ring" / "tree": that everywhere (`collective_seconds`)."""
    cal, chip = calibration, calibration.chip
    kernel = cal.allreduce_kernels.get(k.strategy)
    if kernel and k.hosts <= 1 and link.hw == "nvlink" and k.ranks > 1:
        return *allreduce_kernel_seconds(kernel, k.nbytes, k.ranks), kernel.name
    nccl = algorithm == "nccl" and k.collective in ("all-reduce", "all-gather", "reduce-scatter")
    if nccl and k.hosts <= 1 and in_host:
        return _one_host_pick(k.collective, k.nbytes, k.ranks, link, chip.arch, cal.nccl, nvls)
    if nccl and k.hosts > 1:
        s, lat = (
            nccl_seconds(
                k.collective,
                n,
                k.ranks,
                link,
                hosts=k.hosts,
                inter_host=cal.inter_host,
                tuning=cal.nccl,
                arch=chip.arch,
            )[0]
            for n in (k.nbytes, 0.0)
        )
        return s, lat, ""
    s, lat = (
        collective_seconds(
            k.collective,
            n,
            k.ranks,
            link,
            "ring" if algorithm == "nccl" else algorithm,
            hosts=k.hosts,
            inter_host=cal.inter_host,
        )
        for n in (k.nbytes, 0.0)
    )
    return s, lat, ""


def allreduce_kernel_seconds(
    kernel: hardware.AllReduceKernel, nbytes: float, ranks: int
) -> tuple[float, float]:
    """(seconds, latency) of an all-reduce of `nbytes` over `ranks` GPUs on XLA's `kernel`
    (`hardware.AllReduceKernel`): one_shot reads the n - 1 other buffers, two_shot moves
    2 (n - 1) / n of the bytes (a reduce-scatter, then an all-gather)."""
    moved = (ranks - 1) if kernel.name == "one_shot" else 2 * (ranks - 1) / ranks
    return kernel.base_s + moved * nbytes / kernel.link_bytes_per_s, kernel.base_s
