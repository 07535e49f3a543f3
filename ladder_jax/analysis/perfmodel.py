"""Predict tokens/s of each residual scheme on GPUs you do not have, from the schedule XLA
compiles for them.

    python -m ladder_jax.predict --preset llama-3-70b --tp 8 --batch 1 --link nvlink pcie
    rows = lj.predict("llama-3-70b", tp=[2, 4, 8])

Compile the decoder's prefill and one-token step deviceless (`programs`), read the scheduled
ENTRY computation (`hlo`), cost each kernel as a roofline plus a fixed overhead and each
collective as NCCL's tuner times and picks it (within a host and across hosts), then
replay the compute and collective streams exactly as scheduled (`simulate`), with contention.
3- and 4-layer compiles are extended linearly to full depth. The calibration is
`ladder_jax.hardware`, never fitted to a measured model throughput. Method, flags and what it
leaves out: docs/analysis.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import re
import time

import jax

from ladder_jax import hardware
from ladder_jax.analysis import hlo, programs
from ladder_jax.config import RESIDUALS
from ladder_jax.model import ragged, sharding

ALGORITHMS = ("nccl", "ring", "tree")  # how collectives are timed (`costed`)


class PredictError(ValueError):
    """Arguments the model cannot run with; the message says what to use instead."""


# ---------------------------------------------------------------------------------------------
# Reading the scheduled program: one Kernel per entry that takes time.


@dataclasses.dataclass(frozen=True)
class Kernel:
    """`kind`: compute (a kernel on the compute stream), start / done (an async collective:
    `name` pairs them), sync (a collective that blocks both streams). `nbytes` is what a
    compute kernel moves through HBM, or the collective's message size; a collective runs over
    `ranks` GPUs on `hosts` hosts."""

    kind: str
    name: str
    flops: float = 0.0
    nbytes: float = 0.0
    collective: str = ""
    layer: int | None = None
    ranks: int = 1
    hosts: int = 1
    tiles: int = 0  # a GEMM's thread-block tiles (`gemm_tiles`; 0: not known)


_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "after-all",
    "add-dependency",
    "domain",
    "iota",
}
_SLICES = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # operand 0 updated in place: the update


def _flops(module: hlo.Module, comp: str) -> float:
    """FLOPs of the dots of `comp` and of the computations its fusions call."""
    total = 0.0
    for op in module.computations.get(comp, ()):
        if op.opcode == "dot":
            lhs = module.op(comp, op.operands[0]).dims
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", op.text)
            contracted = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i)
            total += 2.0 * op.elements * contracted
        elif op.opcode == "fusion":
            total += _flops(module, module.called(op))
    return total


def _fusion_cost(module: hlo.Module, op: hlo.Op) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of an ENTRY fusion."""
    comp = module.called(op)
    body = module.computations[comp]
    flops = _flops(module, comp)
    if not flops and op.op_name.endswith("dot_general"):  # a matmul as multiply-reduce
        flops = 2.0 * max(o.elements for o in body)
    users: dict[str, list] = {}
    for o in body:
        for pos, name in enumerate(o.operands):
            users.setdefault(name, []).append((o, pos))
    params = {
        int(re.search(r"parameter\((\d+)\)", o.text).group(1)): o
        for o in body
        if o.opcode == "parameter"
    }
    nbytes = 0.0
    for k, name in enumerate(op.operands):
        uses = _through_bitcasts(params[k].name, users)
        if uses and all(u.opcode in _SLICES and pos == 0 for u, pos in uses):
            nbytes += sum(hlo.nbytes(u.shape) for u, _ in uses)
        elif uses and all(u.opcode in _IN_PLACE and pos == 0 for u, pos in uses):
            pass  # the buffer updated in place: only the update moves (counted as output)
        else:
            nbytes += hlo.nbytes(module.op("ENTRY", name).shape)
    root = next(o for o in body if o.is_root)
    outs = [module.op(comp, n) for n in root.operands] if root.opcode == "tuple" else [root]
    for o in outs:
        while o.opcode == "bitcast":
            o = module.op(comp, o.operands[0])
        if o.opcode in _IN_PLACE:  # the update: a dynamic-update-slice's 1, a scatter's 2
            nbytes += hlo.nbytes(module.op(comp, o.operands[_IN_PLACE[o.opcode]]).shape)
        else:
            nbytes += hlo.nbytes(o.shape)
    return flops, nbytes


def _plain_cost(module: hlo.Module, op: hlo.Op, filled: float = 1.0) -> tuple[float, float]:
    """(FLOPs, bytes) of a non-fusion kernel: operands in, result out. The decode step's
    ragged attention (`ladder_jax.model.ragged`) reads only the `filled` fraction of its
    cache operands, the last two: operands queries, positions, keys, values
    (`attend_filled`), or the q/k/v rows, positions, RoPE frequencies, keys, values
    (`attend_new`), whose cache outputs alias those operands and write one slot each. The
    rows operand counts at the q/k/v columns the kernel reads: the parallel scheme hands it
    its whole five-way projection, whose gate and up columns it leaves unread."""
    entry = [module.op("ENTRY", n) for n in op.operands]
    sizes = [hlo.nbytes(o.shape) if o is not None else 0 for o in entry]
    out_bytes = hlo.nbytes(op.shape)
    flops = 0.0
    if op.opcode == "custom-call" and ragged.KERNEL_NAME in op.text and len(sizes) in (4, 5):
        caches, sizes[-2:] = sizes[-2:], [filled * n for n in sizes[-2:]]
        B_, K_, H_, S_ = entry[-2].dims  # keys (B, K, H, S)
        queries = entry[0].elements  # (B, K, M, H) or rows (B, C), C >= (N + 2K) H
        if len(sizes) == 5:
            # the output (B, K, G, H), or its splits' partials (B, K, splits, G, H): N = K G
            queries = B_ * K_ * op.dims[-2] * H_
            sizes[0] *= (queries + 2 * B_ * K_ * H_) / entry[0].elements  # q/k/v columns
            out_bytes += sum(n / S_ - n for n in caches)  # updated in place: the new slot
        # two products of the queries with the slots read
        flops = 4.0 * queries * S_ * filled
    nbytes = sum(sizes) + out_bytes
    if op.opcode == "custom-call" and re.search(r'custom_call_target="__cublas', op.text):
        lhs = entry[0].dims
        m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', op.text)
        idx = [int(i) for i in re.findall(r"\d+", m.group(1))] if m else [len(lhs) - 1]
        flops = 2.0 * op.elements * math.prod(lhs[i] for i in idx)
    elif op.opcode == "custom-call" and "xla.gpu.triton" in op.text and not flops:
        flops = _flash_flops(op.op_name, entry)
    return flops, nbytes


def _flash_flops(op_name: str, operands: list) -> float:
    """FLOPs of a flash-attention kernel of this package's (jax's Pallas / Triton attention,
    always causal): q (B, T, H, D) and k (B, S, H, D) are its first two operands; the forward
    does 2 matmuls of 2·B·H·T·S·D each, the backward 5 (scores recomputed, dV, dP, dQ, dK), both
    over the causal fraction of the T x S scores (the kernel skips the blocks above the
    diagonal). Other Triton kernels (the backward's preprocessing) count none."""
    scope = op_name.rsplit("/", 2)[-2] if "/" in op_name else ""
    matmuls = (
        2 if scope == "mha_forward" else 5 if scope in ("mha_backward", "jvp(mha_backward)") else 0
    )
    if not matmuls or len(operands) < 2 or any(o is None or len(o.dims) != 4 for o in operands[:2]):
        return 0.0
    (b, t, h, d), s = operands[0].dims, operands[1].dims[1]
    if t > s:
        return 0.0
    causal = (t * (s - t) + t * (t + 1) / 2) / (t * s)  # query i sees s - t + i + 1 keys
    return matmuls * 2.0 * b * h * t * s * d * causal


def gemm_tiles(op: hlo.Op) -> int:
    """Thread-block tiles of a Triton GEMM fusion, from its backend config: the product over
    the output's dimensions of ceil(dim / tile) for the `output_tiles` of its block-level
    config (trailing dimensions; leading ones without a tile size count one tile per index),
    or batch x ceil(M / block_m) x ceil(N / block_n) x split_k for a `triton_gemm_config`.
    0 where the HLO does not say (a cuBLAS call, any other kernel).

        gemm_tiles(op)  # f32[256,512] with output_tiles sizes [64, 128]: 4 * 4 = 16
    """
    dims = op.dims
    m = re.search(r'"output_tiles":\[\{"sizes":\[([^\]]*)\]', op.text)
    if m and re.search(r'"kind":"__triton\w*gemm', op.text):
        sizes = [int(x) for x in re.findall(r"\d+", m.group(1))]
        if not sizes or len(sizes) > len(dims) or 0 in sizes:
            return 0
        lead = dims[: len(dims) - len(sizes)]
        tail = dims[len(dims) - len(sizes) :]
        return math.prod(lead) * math.prod(-(-d // t) for d, t in zip(tail, sizes))
    m = re.search(r'"triton_gemm_config":\{([^}]*)\}', op.text)
    if m and len(dims) >= 2:
        cfg = dict(re.findall(r'"(\w+)":"?(\d+)"?', m.group(1)))
        bm, bn, split = (int(cfg.get(k, 0)) for k in ("block_m", "block_n", "split_k"))
        if bm and bn:
            *batch, rows, cols = dims
            return math.prod(batch) * -(-rows // bm) * -(-cols // bn) * max(split, 1)
    return 0


def _collective_bytes(module: hlo.Module, op: hlo.Op) -> float:
    """Message size: the larger of what goes in and what comes out."""
    entry = [module.op("ENTRY", n) for n in op.operands]
    inputs = sum(hlo.nbytes(o.shape) for o in entry if o is not None)
    total = hlo.nbytes(op.shape)
    outputs = total - inputs if op.opcode.endswith("-start") and total > inputs else total
    return float(max(inputs, outputs))


def _through_bitcasts(name, users) -> list:
    out = []
    for u, pos in users.get(name, ()):
        out += _through_bitcasts(u.name, users) if u.opcode == "bitcast" else [(u, pos)]
    return out


def read_kernels(
    text: str, *, devices: int = 1, gpus_per_host: int | None = None, filled: float = 1.0
) -> list[Kernel]:
    """The ENTRY computation of a scheduled module as Kernels, in schedule order. A
    collective's ranks and hosts come from its replica group (device ids numbered host by host,
    `gpus_per_host` each; no group: all `devices`). `filled`: the fraction of the KV cache's
    slots a decode step's ragged attention reads (`decode_fill`)."""
    try:
        module = hlo.Module(text)
    except hlo.HloError as e:
        raise PredictError(str(e)) from None
    per_host = gpus_per_host or max(devices, 1)
    kernels, sync = [], set()
    for op in module.entry:
        code = op.opcode
        if code in _FREE:
            continue
        collective = module.collective(op)
        if code.endswith("-done") and code != "copy-done":
            start = op.operands[0]
            if start not in sync:
                kernels.append(Kernel("done", start, layer=op.layer))
            continue
        if collective and (code.endswith("-start") or code == collective):
            kind = "sync" if code == collective or op.is_sync else "start"
            if kind == "sync":
                sync.add(op.name)
            group = op.replica_group or list(range(devices))
            kernels.append(
                Kernel(
                    kind,
                    op.name,
                    nbytes=_collective_bytes(module, op),
                    collective=collective,
                    layer=op.layer,
                    ranks=len(group),
                    hosts=len({d // per_host for d in group}),
                )
            )
        elif code.endswith("-start") and code != "copy-start":  # an async op of no known kind
            kind = "sync" if op.is_sync else "start"
            if kind == "sync":
                sync.add(op.name)
            kernels.append(
                Kernel(
                    kind,
                    op.name,
                    nbytes=_collective_bytes(module, op),
                    collective="other",
                    layer=op.layer,
                    ranks=devices,
                )
            )
        else:
            flops, nbytes = (
                _fusion_cost(module, op) if code == "fusion" else _plain_cost(module, op, filled)
            )
            tiles = gemm_tiles(op) if flops and code == "fusion" else 0
            kernels.append(Kernel("compute", op.name, flops, nbytes, layer=op.layer, tiles=tiles))
    return kernels


# ---------------------------------------------------------------------------------------------
# Costs.


def kernel_seconds(k: Kernel, chip: hardware.Chip, eff: hardware.Efficiency) -> float:
    """Roofline of one compute kernel plus the fixed per-kernel overhead."""
    flops_s, bytes_s = _roofline(k, chip, eff)
    return max(flops_s, bytes_s) + eff.kernel_overhead_s


def _roofline(k: Kernel, chip, eff) -> tuple[float, float]:
    return k.flops / (chip.bf16_flops * eff.gemm), k.nbytes / (chip.hbm_bytes_per_s * eff.memory)


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
    for proto in _PROTOCOLS:
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


_PROTOCOLS = hardware._PROTOCOLS


def bus_bytes(collective: str, nbytes: float, ranks: int, algorithm: str = "ring") -> float:
    """Bytes one GPU sends for a collective (what its copies move)."""
    return nbytes * _ring(collective, ranks, algorithm)[1]


@dataclasses.dataclass(frozen=True)
class Timed:
    """One op of the two-stream replay. compute: `seconds` alone on the GPU, of which
    `flops_s` / `bytes_s` are the roofline's two terms (the rest is fixed overhead). start /
    sync: the collective's `seconds`, and the shares of the SMs and of the HBM bandwidth it
    takes from the kernels beside it. done: waits for the start of the same `name`."""

    kind: str
    name: str
    seconds: float
    layer: int | None = None
    flops_s: float = 0.0
    bytes_s: float = 0.0
    sm_share: float = 0.0
    hbm_share: float = 0.0
    issue_s: float = 0.0  # host time to issue it (`hardware.Launch`), before it can start
    latency_s: float = 0.0  # of a collective's `seconds`, the part that moves no data
    wait_s: float = 0.0  # start / done: the device's cross-stream wait (`stream_waits`)
    tiles: int = 0  # compute: its thread-block tiles, and the chip's SMs they fill in waves
    sms: int = 0  # (`flops_slowdown`; 0: no wave quantization)


def flops_slowdown(sm_share: float, tiles: int = 0, sms: int = 0) -> float:
    """How much longer a kernel's FLOP-bound work takes while a collective holds `sm_share` of
    the chip's SMs. Without its tiles (or `sms`): 1 / (1 - sm_share), the SMs lost. With them,
    wave quantization: the kernel's `tiles` thread-block tiles run in waves of one tile per
    SM, ceil(tiles / sms) waves alone and ceil(tiles / (sms - c)) beside a collective on
    c = round(sm_share * sms) SMs, so the slowdown is their ratio (1 when the tiles fit in the
    SMs left; tending to 1 / (1 - sm_share) for many tiles).

        flops_slowdown(16 / 132, tiles=132, sms=132)  # 2 waves instead of 1: 2.0
    """
    if sm_share <= 0:
        return 1.0
    if tiles <= 0 or sms <= 0:
        return 1.0 / (1.0 - sm_share)
    left = max(sms - round(sm_share * sms), 1)
    return math.ceil(tiles / left) / math.ceil(tiles / sms)


def launch_plan(kernels, launch: hardware.Launch, mode: str = "graphs") -> list[tuple[float, bool]]:
    """(host seconds to issue it, whether it runs in a command buffer) of each kernel of a
    schedule (`hardware.Launch`). "graphs": a run of at least `launch.min_graph` compute
    kernels between collective ops is one command buffer (its first kernel carries the graph
    launch, the rest nothing), shorter runs are launched one by one; "streams": every kernel
    launched one by one; "off": nothing (the host is never what the GPU waits for; kernels
    costed as graph nodes, as before this model). Collective starts and blocking collectives
    cost `launch.collective_s`, a done nothing (a stream wait)."""
    if mode not in hardware.LAUNCH_MODES:
        raise PredictError(
            f"unknown launch mode {mode!r}: choose one of {', '.join(hardware.LAUNCH_MODES)}"
        )
    if mode == "off":
        return [(0.0, True)] * len(kernels)
    out = [(0.0, False)] * len(kernels)
    run: list[int] = []

    def close():
        graph = mode == "graphs" and len(run) >= launch.min_graph
        for j, i in enumerate(run):
            out[i] = (
                (launch.graph_s if j == 0 else 0.0, True) if graph else (launch.kernel_s, False)
            )
        run.clear()

    for i, k in enumerate(kernels):
        if k.kind == "compute":
            run.append(i)
            continue
        close()
        if k.kind in ("start", "sync"):
            out[i] = (launch.collective_s, False)
    close()
    return out


def stream_waits(ops: list[Timed], seconds: float) -> list[Timed]:
    """`ops` with the device's cross-stream wait (`hardware.Launch.stream_sync_s`) on every
    asynchronous collective: its start waits for the compute stream's event, its done for
    the collective's. Blocking collectives (sync) run on the compute stream: no wait.

        ops = stream_waits(costed(kernels, ...), cal.launch.stream_sync_s)
    """
    return [
        dataclasses.replace(o, wait_s=seconds) if o.kind in ("start", "done") else o for o in ops
    ]


def costed(
    kernels,
    *,
    calibration: hardware.Calibration,
    link: hardware.Link,
    algorithm: str = "nccl",
    contention: bool = True,
    launch: str = "off",
    in_host: bool = True,
    nvls: bool = True,
    waves: bool = True,
) -> list[Timed]:
    """What `simulate` replays: every kernel timed with `calibration` (intra-host `link`).
    `algorithm`: "nccl" times a collective as NCCL picks it, across hosts (`nccl_seconds`)
    and, with `in_host`, within one (`nccl_one_host_seconds`, NVLS with `nvls`; without
    `in_host` a ring at LL's latency); "ring" / "tree": that everywhere
    (`collective_seconds`). A collective on NVLS takes its channels' SMs, at most
    `NcclTuning.nvls_channels`. `launch`: how the host issues the kernels (`launch_plan`); a
    kernel launched outside a command buffer also pays `stream_gap_s` more on the GPU.
    `waves`: a GEMM whose tiles the HLO gives is slowed beside a collective by whole waves of
    its tiles on the SMs left (`flops_slowdown`), else by the share of SMs taken."""
    cal, out = calibration, []
    chip, eff, con = cal.chip, cal.efficiency, cal.contention
    plan = launch_plan(kernels, cal.launch, launch)
    issue = [p[0] for p in plan]
    for i, k in enumerate(kernels):
        if k.kind == "compute":
            flops_s, bytes_s = _roofline(k, chip, eff)
            gap = eff.kernel_overhead_s + (0.0 if plan[i][1] else cal.launch.stream_gap_s)
            out.append(
                Timed(
                    "compute",
                    k.name,
                    max(flops_s, bytes_s) + gap,
                    k.layer,
                    flops_s,
                    bytes_s,
                    issue_s=issue[i],
                    tiles=k.tiles if waves else 0,
                    sms=chip.sms if waves else 0,
                )
            )
        elif k.kind == "done":
            out.append(Timed("done", k.name, 0.0, k.layer))
        else:
            how = ""
            nccl = algorithm == "nccl" and k.collective in (
                "all-reduce",
                "all-gather",
                "reduce-scatter",
            )
            if nccl and k.hosts <= 1 and in_host:
                s, lat, how = _one_host_pick(
                    k.collective, k.nbytes, k.ranks, link, chip.arch, cal.nccl, nvls
                )
            elif nccl and k.hosts > 1:
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
            else:
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
            sm = hbm = 0.0
            if contention and s > 0:
                most = min(link.channels, cal.nccl.nvls_channels) if how == "nvls/Simple" else None
                channels = min(
                    most or link.channels, max(1, math.ceil(k.nbytes / con.bytes_per_channel))
                )
                sm = min(channels / chip.sms, 0.9)
                rate = bus_bytes(k.collective, k.nbytes, k.ranks, algorithm) / s
                hbm = min(
                    con.hbm_bytes_per_bus_byte * rate / (chip.hbm_bytes_per_s * eff.memory), 0.9
                )
            out.append(
                Timed(
                    k.kind,
                    k.name,
                    s,
                    k.layer,
                    sm_share=sm,
                    hbm_share=hbm,
                    issue_s=issue[i],
                    latency_s=min(lat, s),
                )
            )
    return out


# ---------------------------------------------------------------------------------------------
# Two streams.


@dataclasses.dataclass(frozen=True)
class Timeline:
    seconds: float  # until both streams are idle
    compute_s: float  # busy time of the compute stream
    comm_s: float  # busy time of the collective stream

    @property
    def exposed_comm_s(self) -> float:
        return self.seconds - self.compute_s


@dataclasses.dataclass(frozen=True)
class Span:
    """One op's time on its stream in a replay (`simulate(..., trace=[])`): `stream` is
    "kernel" (a compute kernel, from when the compute stream began it, its fixed overhead
    and any slowdown included) or "collective" (from when the collective stream began it to
    its end); `name` and `layer` are the op's."""

    stream: str
    name: str
    start: float
    end: float
    layer: int | None = None


def simulate(
    ops, step_s: float = 0.0, copy_rate: float = 1.0, trace: list | None = None
) -> Timeline:
    """Replays `Timed` ops (or (kind, name, seconds, layer) tuples: no contention) on a compute
    and a collective stream, issued by a host.

    compute: runs on the compute stream, slowed while a collective is in flight (its work
    progresses at 1 / max(flops_s * flops_slowdown(sm_share, tiles, sms), bytes_s / (1 -
    hbm_share)) of the whole per second then, at 1 / max(flops_s, bytes_s) otherwise; its fixed
    overhead is not slowed). start: the collective is issued when the compute stream reaches it
    and runs on the collective stream after the collectives before it. done: the compute stream
    waits until that collective has finished. sync: a blocking collective (waits for the
    collective stream, then holds both). The host issues the ops in order, `issue_s` each; none
    starts before it is issued; a start's collective begins no sooner than `wait_s` after the
    compute stream reached it, and a done lets the compute stream go on `wait_s` after its
    collective ended (`stream_waits`); `step_s` (the program's dispatch, overlapped with the
    previous call) is host time too, so the program lasts at least the host's total.
    `compute_s` counts the slowed kernels' whole time and the compute stream's waits for the
    host: contention and launch-bound gaps are compute time, not exposed communication.
    `copy_rate` < 1: while a kernel runs beside it, a collective moves its data (`seconds -
    latency_s`) at that share of its own rate (`_Replay`: the contention goes both ways).
    `trace`: a list that gets a `Span` for every kernel and collective, each stream's in the
    order they begin, to print the timeline (`benchmarks/ladder_bound.py --timeline`).

        spans = []; simulate(ops, trace=spans)

    Invariants of the trace: each stream's spans are disjoint and in order, the last ends at
    `seconds` less the launch-bound time, the collectives' durations sum to `comm_s`."""
    if copy_rate < 1.0:
        return _Replay(copy_rate, trace).run(ops, step_s)
    now = free = busy = comm = host = 0.0
    ends, flights = {}, []  # flights: (start, end, sm_share, hbm_share) of issued collectives
    for op in ops:
        if not isinstance(op, Timed):
            op = Timed(*op)
        host += op.issue_s
        if op.kind == "compute":
            t = _run_kernel(op, max(now, host), flights)
            if trace is not None:
                trace.append(Span("kernel", op.name, max(now, host), t, op.layer))
            busy += t - now
            now = t
            flights = [f for f in flights if f[1] > now]
        elif op.kind == "start":
            begin = max(now + op.wait_s, free, host)
            free = begin + op.seconds
            ends[op.name] = free
            comm += op.seconds
            if trace is not None:
                trace.append(Span("collective", op.name, begin, free, op.layer))
            if op.seconds > 0 and (op.sm_share or op.hbm_share):
                flights.append((begin, free, op.sm_share, op.hbm_share))
        elif op.kind == "done":
            now = max(now, ends.pop(op.name) + op.wait_s)
        elif op.kind == "sync":
            begin = max(now, free, host)
            now = free = begin + op.seconds
            comm += op.seconds
            if trace is not None:
                trace.append(Span("collective", op.name, begin, free, op.layer))
        else:
            raise ValueError(f"unknown op kind {op.kind!r}")
    end = max(now, free)
    launch_bound = max(0.0, host + step_s - end)
    return Timeline(end + launch_bound, busy + launch_bound, comm)


class _Replay:
    """`simulate` where a collective's copies slow down beside a running kernel: an event
    replay of both streams. The collective stream runs its queue in order, each collective its
    latency first at full speed, then its data at `copy_rate` of its speed while a kernel's
    work runs on the compute stream (its fixed overhead excluded), at full speed otherwise.
    The kernel beside it is slowed by the collective's SM and HBM shares, as in `simulate`."""

    def __init__(self, copy_rate: float, trace: list | None = None):
        self.rate = copy_rate
        self.trace = trace  # `simulate`'s
        self.queue: list = []  # [op, issued at, latency left, data seconds left, started at]
        self.t = 0.0  # the collective stream's clock
        self.ends: dict = {}
        self.comm = 0.0

    def advance(self, until: float, beside: bool) -> None:
        """The collective stream from its clock to `until`, a kernel's work running beside it
        (`beside`) or not."""
        while self.t < until and self.queue:
            head = self.queue[0]
            if self.t < head[1]:  # idle until the next is issued
                self.t = min(head[1], until)
                continue
            if head[4] is None:
                head[4] = self.t
            rate = self.rate if beside else 1.0
            need = head[2] + head[3] / rate
            if self.t + need <= until:
                self.t += need
                self.ends[head[0].name] = self.t
                self.comm += self.t - head[4]
                if self.trace is not None:
                    self.trace.append(
                        Span("collective", head[0].name, head[4], self.t, head[0].layer)
                    )
                self.queue.pop(0)
                continue
            dt = until - self.t
            lat = min(head[2], dt)
            head[2] -= lat
            head[3] -= (dt - lat) * rate
            self.t = until
        self.t = max(self.t, until) if not self.queue else self.t

    def head(self, t: float):
        """The collective in flight at `t` (the stream's clock is at `t`), or None."""
        if self.queue and self.queue[0][1] <= t:
            return self.queue[0]
        return None

    def head_left(self, head, beside: bool) -> float:
        return head[2] + head[3] / (self.rate if beside else 1.0)

    def drain_until(self, name: str | None = None) -> float:
        """Runs the queue, nothing beside it, until collective `name` has ended (None: all);
        its end (popped), or the stream's clock."""
        while self.queue and (name is None or name not in self.ends):
            self.advance(
                max(self.t, self.queue[0][1]) + self.head_left(self.queue[0], False), False
            )
        return self.t if name is None else self.ends.pop(name)

    def kernel(self, op: Timed, start: float) -> float:
        """When a compute kernel issued for `start` ends."""
        self.advance(start, False)
        work = max(op.flops_s, op.bytes_s)
        t = start + (op.seconds - work)  # the fixed overhead first, nothing beside it
        self.advance(t, False)
        left = 1.0
        while work > 0 and left > 0:
            head = self.head(t)
            if head is None:
                nxt = self.queue[0][1] if self.queue else math.inf
                if t + left * work <= nxt:
                    self.advance(t + left * work, True)
                    return t + left * work
                left -= (nxt - t) / work
                self.advance(nxt, True)
                t = nxt
                continue
            slowed = max(
                op.flops_s * flops_slowdown(head[0].sm_share, op.tiles, op.sms),
                op.bytes_s / (1 - head[0].hbm_share),
            )
            until = t + self.head_left(head, True)
            if t + left * slowed <= until:
                self.advance(t + left * slowed, True)
                return t + left * slowed
            left -= (until - t) / slowed
            self.advance(until, True)
            t = until
        return t

    def run(self, ops, step_s: float) -> Timeline:
        now = busy = host = 0.0
        for op in ops:
            if not isinstance(op, Timed):
                op = Timed(*op)
            host += op.issue_s
            if op.kind == "compute":
                t = self.kernel(op, max(now, host))
                if self.trace is not None:
                    self.trace.append(Span("kernel", op.name, max(now, host), t, op.layer))
                busy += t - now
                now = t
            elif op.kind == "start":
                lat = min(op.latency_s, op.seconds)
                self.queue.append([op, max(now + op.wait_s, host), lat, op.seconds - lat, None])
            elif op.kind == "done":
                now = max(now, self.drain_until(op.name) + op.wait_s)
            elif op.kind == "sync":
                self.drain_until()
                begin = max(now, self.t, host)
                now = self.t = begin + op.seconds
                self.comm += op.seconds
                if self.trace is not None:
                    self.trace.append(Span("collective", op.name, begin, now, op.layer))
            else:
                raise ValueError(f"unknown op kind {op.kind!r}")
        self.drain_until()
        end = max(now, self.t)
        launch_bound = max(0.0, host + step_s - end)
        return Timeline(end + launch_bound, busy + launch_bound, self.comm)


def _run_kernel(op: Timed, now: float, flights) -> float:
    """When a compute kernel started at `now` ends, through the collectives in flight."""
    work = max(op.flops_s, op.bytes_s)
    t = now + (op.seconds - work)  # the fixed overhead first
    left = 1.0  # fraction of the work still to do
    if work <= 0:
        return t
    for begin, end, sm, hbm in flights:
        if end <= t:
            continue
        if begin > t:  # full speed until this collective starts
            if t + left * work <= begin:
                return t + left * work
            left -= (begin - t) / work
            t = begin
        slowed = max(op.flops_s * flops_slowdown(sm, op.tiles, op.sms), op.bytes_s / (1 - hbm))
        if t + left * slowed <= end:
            return t + left * slowed
        left -= (end - t) / slowed
        t = end
    return t + left * work


def extended(
    shallow: Timeline, deep: Timeline, n_layers: int, deep_layers: int
) -> tuple[float, float]:
    """(seconds, compute seconds) at `n_layers`, from timelines of `deep_layers - 1` and
    `deep_layers` layers: each missing layer adds their difference."""
    extra = n_layers - deep_layers
    return (
        deep.seconds + extra * (deep.seconds - shallow.seconds),
        deep.compute_s + extra * (deep.compute_s - shallow.compute_s),
    )


# ---------------------------------------------------------------------------------------------
# Programs and predictions.


@dataclasses.dataclass(frozen=True)
class Program:
    kernels: tuple
    fallback: str | None = None


def decode_fill(config, *, prompt_len: int, new_tokens: int, slots: int | None = None) -> float:
    """The fraction of a decode cache's slots that the average step of a request reads: its
    mid-decode length, prompt_len + new_tokens / 2, over the slots per row (`slots`, or what
    `decode` sizes for the request: then about 1 - new_tokens / 2 / slots)."""
    from ladder_jax.inference.cache import cache_length

    S = slots or cache_length(config, prompt_len, new_tokens)
    return min(1.0, (prompt_len + new_tokens / 2) / S)


def program_kernels(
    config,
    *,
    phase: str,
    tp: int,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    target: str,
    hosts: int = 1,
    slots: int | None = None,
) -> Program:
    """The compiled program's kernels (compiled once per process and shape, however the
    arguments are spelled; the persistent cache of `ladder_jax.analysis.programs` keeps them
    across processes). `slots`: the decode cache's slots per row (default: sized for the
    request), of which the decode step's attention reads the request's average filled length
    (`decode_fill`)."""
    return _program(config, phase, tp, batch, prompt_len, new_tokens, target, hosts, slots)


@functools.lru_cache(maxsize=None)
def _program(config, phase, tp, batch, prompt_len, new_tokens, target, hosts, slots) -> Program:
    """`program_kernels`, its arguments in one order: one cache entry per program."""
    text, _ = programs.compile_program(
        config,
        phase=phase,
        tp=tp,
        batch=batch,
        seq=prompt_len,
        target=target,
        new_tokens=new_tokens,
        hosts=hosts,
        **({"slots": slots} if slots is not None else {}),
    )
    fallback = programs.LAST["fallback"]
    filled = (
        decode_fill(config, prompt_len=prompt_len, new_tokens=new_tokens, slots=slots)
        if phase == "decode"
        else 1.0
    )
    return Program(
        tuple(read_kernels(text, devices=tp, gpus_per_host=tp // hosts, filled=filled)), fallback
    )


program_kernels.cache_info = _program.cache_info
program_kernels.cache_clear = _program.cache_clear


def check_layers_compiled(layers_compiled: int) -> None:
    if layers_compiled != 0 and layers_compiled < 2:
        raise PredictError(
            f"--layers-compiled {layers_compiled}: use 0 (full depth) or >= 2 "
            f"(that many layers and one fewer are compiled; 4 is accurate)"
        )


def compiled_depths(config, layers_compiled: int) -> list[int]:
    """The depths compiled for `config`: all layers, or `layers_compiled` and one fewer."""
    check_layers_compiled(layers_compiled)
    if (
        not layers_compiled
        or config.ladder_layers is not None
        or config.n_layers <= layers_compiled
    ):
        return [config.n_layers]
    return [layers_compiled - 1, layers_compiled]


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


def _tasks(config, phases, depths, **shape) -> list[dict]:
    return [
        dict(config=dataclasses.replace(config, n_layers=d), phase=p, **shape)
        for p in phases
        for d in depths
    ]


def program_time(
    config,
    *,
    phase: str,
    tp: int,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    target: str = "h100",
    link: hardware.Link,
    efficiency: hardware.Efficiency | None = None,
    calibration: hardware.Calibration | None = None,
    hosts: int = 1,
    layers_compiled: int = 4,
    algorithm: str = "nccl",
    contention: bool = True,
    slots: int | None = None,
    launch: str = "graphs",
    copy_contention: bool = True,
    stream_sync: bool = True,
    in_host: bool = True,
    nvls: bool = True,
    waves: bool = True,
) -> dict:
    """Predicted seconds, compute seconds and exposed communication of one program; `slots`:
    the decode cache's slots per row (`program_kernels`); `launch`: how the host issues its
    kernels (`launch_plan`; "off" leaves the host out); `copy_contention`: a collective's copies
    slow down beside a running kernel (`hardware.Contention.copy_rate`; needs `contention`);
    `stream_sync`: asynchronous collectives pay the device's cross-stream waits
    (`stream_waits`; not with launch "off"); `in_host`, `nvls`: NCCL's choice within a host
    (`costed`); `waves`: wave quantization of GEMMs beside a collective (`flops_slowdown`)."""
    cal = calibration or hardware.calibration(target)
    if efficiency is not None:
        cal = dataclasses.replace(cal, efficiency=efficiency)
    depths = compiled_depths(config, layers_compiled)
    full = depths == [config.n_layers]
    timelines, program, works = [], Program(()), []
    fallbacks = set()
    for depth in depths:
        program = program_kernels(
            dataclasses.replace(config, n_layers=depth),
            phase=phase,
            tp=tp,
            batch=batch,
            prompt_len=prompt_len,
            new_tokens=new_tokens,
            target=target,
            hosts=hosts,
            **({"slots": slots} if slots is not None else {}),
        )
        fallbacks.add(program.fallback)
        works.append(work(program.kernels))
        ops = costed(
            program.kernels,
            calibration=cal,
            link=link,
            algorithm=algorithm,
            contention=contention,
            launch=launch,
            in_host=in_host,
            nvls=nvls,
            waves=waves,
        )
        if stream_sync and launch != "off":
            ops = stream_waits(ops, cal.launch.stream_sync_s)
        timelines.append(
            simulate(
                ops,
                step_s=0.0 if launch == "off" else cal.launch.step_s,
                copy_rate=cal.contention.copy_rate if contention and copy_contention else 1.0,
            )
        )
    if full:
        seconds, compute = timelines[0].seconds, timelines[0].compute_s
        done = works[0]
    else:  # the two depths can fuse a kernel differently: keep 0 <= exposed <= seconds
        seconds, compute = extended(*timelines, config.n_layers, layers_compiled)
        compute = min(compute, seconds)
        extra = config.n_layers - layers_compiled
        done = {k: works[1][k] + extra * (works[1][k] - works[0][k]) for k in works[1]}
    fallbacks.discard(None)
    return {
        "seconds": seconds,
        "compute_s": compute,
        "exposed_comm_s": seconds - compute,
        "kernels": sum(k.kind == "compute" for k in program.kernels),
        "work": done,
        "layers_compiled": depths,
        "fallback": ",".join(sorted(fallbacks)) or None,
    }


def work(kernels) -> dict:
    """What a program's compute kernels do, per GPU: HBM bytes, FLOPs and kernel count."""
    compute = [k for k in kernels if k.kind == "compute"]
    return {
        "hbm_bytes": sum(k.nbytes for k in compute),
        "flops": sum(k.flops for k in compute),
        "kernels": len(compute),
    }


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A grid of predictions and what it is costed with. `tp`, `batch`, `links`, `residuals`
    are the grid (every combination); `hosts` is how many hosts each tp group spans (None: as
    few as `gpus_per_host` allows, ceil(tp / gpus_per_host)); `calibration` defaults to the
    public figures of `target` (`hardware.calibration`); `launch`: how the host issues the
    kernels (`launch_plan`: graphs, streams, or off to leave the host out); `copy_contention`:
    collectives slow down beside running kernels too (`hardware.Contention.copy_rate`);
    `slots`: the KV cache's slots per row (a server's `--max-len`; None: sized for the
    request), of which the decode step reads the filled ones (`decode_fill`); `stream_sync`:
    asynchronous collectives pay the device's cross-stream waits (`stream_waits`);
    `nccl_in_host`: a collective within one host as NCCL picks it (algorithm "nccl";
    `nccl_one_host_seconds`), else a ring at LL's latency; `nvls`: NVLink SHARP among its
    options where the chip has it; `waves`: a GEMM beside a collective slowed by whole waves of
    its tiles (`flops_slowdown`), else by the share of SMs taken."""

    tp: tuple = (8,)
    batch: tuple = (1,)
    prompt_len: int = 1024
    new_tokens: int = 512
    links: tuple = ("nvlink",)
    residuals: tuple = RESIDUALS
    target: str = "h100"
    hosts: int | None = None
    gpus_per_host: int = 8
    layers_compiled: int = 4
    algorithm: str = "nccl"
    contention: bool = True
    calibration: hardware.Calibration | None = None
    launch: str = "graphs"
    copy_contention: bool = True
    slots: int | None = None
    stream_sync: bool = True
    nccl_in_host: bool = True
    nvls: bool = True
    waves: bool = True

    def __post_init__(self):
        for name in ("tp", "batch", "links", "residuals"):
            object.__setattr__(self, name, _as_tuple(getattr(self, name)))
        if self.calibration is None and self.target in hardware.CHIPS:
            object.__setattr__(self, "calibration", hardware.calibration(self.target))

    def hosts_for(self, tp: int) -> int:
        return self.hosts if self.hosts is not None else max(1, -(-tp // self.gpus_per_host))

    def costing(self, tp: int, link: str) -> dict:
        """The `program_time` keywords that cost a program of this sweep at `tp` on `link`.

        program_time(cfg, phase="decode", tp=8, batch=1, ..., **sweep.costing(8, "nvlink"))
        """
        return dict(
            link=self.calibration.links[link],
            calibration=self.calibration,
            hosts=self.hosts_for(tp),
            layers_compiled=self.layers_compiled,
            algorithm=self.algorithm,
            contention=self.contention,
            launch=self.launch,
            copy_contention=self.copy_contention,
            stream_sync=self.stream_sync,
            in_host=self.nccl_in_host,
            nvls=self.nvls,
            waves=self.waves,
        )

    def check(self, config, *, phase: str = "generate") -> None:
        """Every field, before anything compiles: one line naming the fix."""
        if self.target not in hardware.TARGETS:
            raise PredictError(
                f"unknown target {self.target!r}: choose one of {', '.join(hardware.TARGETS)}"
            )
        for name in self.links:
            if name not in self.calibration.links:
                raise PredictError(
                    f"unknown link {name!r}: choose one of {', '.join(self.calibration.links)}"
                )
        for r in self.residuals:
            if r not in RESIDUALS:
                raise PredictError(
                    f"unknown residual {r!r}: choose one of {', '.join(RESIDUALS)} or all"
                )
        if self.algorithm not in ALGORITHMS:
            raise PredictError(
                f"unknown algorithm {self.algorithm!r}: choose one of {', '.join(ALGORITHMS)}"
            )
        if self.launch not in hardware.LAUNCH_MODES:
            raise PredictError(
                f"unknown launch mode {self.launch!r}: choose one of "
                f"{', '.join(hardware.LAUNCH_MODES)}"
            )
        check_layers_compiled(self.layers_compiled)
        ints = [
            ("prompt_len" if phase == "generate" else "seq_len", self.prompt_len),
            ("gpus_per_host", self.gpus_per_host),
        ]
        if phase == "generate":
            ints.append(("new_tokens", self.new_tokens))
        ints += [("tp", t) for t in self.tp] + [("batch", b) for b in self.batch]
        if self.hosts is not None:
            ints.append(("hosts", self.hosts))
        if self.slots is not None:
            ints.append(("slots", self.slots))
        for name, v in ints:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PredictError(f"{name}={v!r} must be a positive integer")
        if self.slots is not None and self.slots < self.prompt_len + self.new_tokens:
            raise PredictError(
                f"slots={self.slots} cannot hold the prompt and the new tokens: "
                f"use at least {self.prompt_len + self.new_tokens} "
                f"(prompt_len + new_tokens)"
            )
        for t in self.tp:
            h = self.hosts_for(t)
            if t % h or t // h > self.gpus_per_host:
                raise PredictError(
                    f"tp={t} cannot span {h} host(s) of {self.gpus_per_host} GPUs evenly: "
                    f"use --hosts H with tp/H a whole number <= --gpus-per-host"
                )
            sharding.check_divisible(config, t)
        check_calibration(self.calibration)


def check(
    config,
    *,
    tp: int,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    link: str,
    target: str,
    residual: str,
) -> None:
    """Every argument of one prediction, before anything compiles: one line naming the fix."""
    Sweep(
        tp=tp,
        batch=batch,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        links=link,
        target=target,
        residuals=residual,
    ).check(config)


def _sweep(sweep: Sweep | None, efficiency=None, link_overrides=None, **fields) -> Sweep:
    """A Sweep from keywords (the older spelling: efficiency=, link_overrides= replace
    calibration figures)."""
    sweep = dataclasses.replace(sweep, **fields) if sweep else Sweep(**fields)
    if sweep.target not in hardware.TARGETS:
        raise PredictError(
            f"unknown target {sweep.target!r}: choose one of {', '.join(hardware.TARGETS)}"
        )
    if sweep.calibration.target != sweep.target:
        sweep = dataclasses.replace(sweep, calibration=hardware.calibration(sweep.target))
    if efficiency is not None or link_overrides:
        cal = sweep.calibration
        if efficiency is not None:
            cal = dataclasses.replace(cal, efficiency=efficiency)
        if link_overrides:
            cal = _checked(lambda: cal.replace(links={"*": dict(link_overrides)}))
        sweep = dataclasses.replace(sweep, calibration=cal)
    return sweep


def _checked(fn):
    try:
        return fn()
    except ValueError as e:
        raise PredictError(str(e)) from None


def predict(
    config,
    sweep: Sweep | None = None,
    *,
    jobs: int | None = None,
    progress=None,
    name: str | None = None,
    efficiency: hardware.Efficiency | None = None,
    link_overrides: dict | None = None,
    **fields,
) -> list[dict]:
    """One row per (tp, batch, residual, link) of `sweep` (or a Sweep of `fields`): predicted
    prefill and decode-step seconds, tokens/s (all users and per user) and exposed
    communication. `config` is a ModelConfig (its `residual` is replaced by each of the
    sweep's; `ladder_layers` kept for ladder); `name` (the preset) goes into error messages;
    `efficiency` / `link_overrides` replace calibration figures (e.g.
    link_overrides=dict(bus_bytes_per_s=300e9) for every link). `progress(done, total,
    eta_s[, stage])`: compiling (`compile_all`), then stage "costing" per row."""
    from ladder_jax.analysis import roofline  # it reads programs through this module

    sweep = _sweep(sweep, efficiency, link_overrides, **fields)
    sweep.check(config)
    pool_fraction()  # a bad XLA_PYTHON_CLIENT_MEM_FRACTION before anything compiles
    programs.check_plugin()
    base = dataclasses.replace(
        config,
        max_seq_len=max(config.max_seq_len, sweep.slots or 0, sweep.prompt_len + sweep.new_tokens),
    )
    cases = _cases(sweep, base)
    shape = dict(
        prompt_len=sweep.prompt_len,
        new_tokens=sweep.new_tokens,
        target=sweep.target,
        **({"slots": sweep.slots} if sweep.slots is not None else {}),
    )
    _compile_cases(name, sweep, cases, ("prefill", "decode"), shape, jobs, progress)
    rows, n, t0 = [], len(cases) * len(sweep.links), time.perf_counter()
    for t, b, cfg in cases:
        for link_name in sweep.links:
            if progress:  # reading and costing each compiled program takes a while too
                k = len(rows)
                eta = (time.perf_counter() - t0) / k * (n - k) if k else None
                progress(k, n, eta, "costing")
            kw = dict(tp=t, batch=b, **shape, **sweep.costing(t, link_name))
            pre = program_time(cfg, phase="prefill", **kw)
            step = program_time(cfg, phase="decode", **kw)
            rows.append(
                {
                    **_row(cfg, sweep, t, b, link_name, pre, step),
                    **context_length(config, base),
                    **decode_memory(
                        cfg,
                        tp=t,
                        batch=b,
                        prompt_len=sweep.prompt_len,
                        new_tokens=sweep.new_tokens,
                        target=sweep.target,
                        hosts=sweep.hosts_for(t),
                        slots=sweep.slots,
                    ),
                    **roofline.roofline_fields(
                        cfg,
                        tp=t,
                        batch=b,
                        **shape,
                        hosts=sweep.hosts_for(t),
                        layers_compiled=sweep.layers_compiled,
                        decode_step_s=step["seconds"],
                        calibration=sweep.calibration,
                    ),
                }
            )
    if progress:
        progress(n, n, None, "costing")
    return mark_above_upper_bound(rows)


def context_length(config, compiled) -> dict:
    """A row's `max_seq_len` (the longest sequence its programs were compiled for) and
    `max_seq_len_raised_from` (the preset's own, where a longer cache row or request raised
    it; else None), so that a raised RoPE table and cache never go unsaid."""
    raised = compiled.max_seq_len > config.max_seq_len
    return {
        "max_seq_len": compiled.max_seq_len,
        "max_seq_len_raised_from": config.max_seq_len if raised else None,
    }


def context_note(rows: list[dict]) -> str:
    """One line when the rows' programs hold longer sequences than the preset's max_seq_len."""
    raised = {
        (r["max_seq_len_raised_from"], r["max_seq_len"])
        for r in rows
        if r.get("max_seq_len_raised_from")
    }
    return "\n".join(
        f"max_seq_len raised from the preset's {old} to {new}: the cache row (--max-len) or "
        f"prompt + new tokens is longer (RoPE table and cache sized for {new})"
        for old, new in sorted(raised)
    )


def mark_above_upper_bound(rows: list[dict]) -> list[dict]:
    """Rows faster (by more than a thousandth) than the upper_bound row of the same link, tp
    and batch get
    `above_upper_bound`: what their programs do less of (HBM bytes, FLOPs, kernels per
    generated token, prefill and decode steps as `_row` counts them), or, where they do no
    less, that the costing is at fault. upper_bound is the same layers without the
    all-reduces, so a scheme can beat it only when XLA compiles it into less work."""
    key = lambda r: (r["link"], r["tp"], r["batch"])  # noqa: E731
    ub = {key(r): r for r in rows if r["residual"] == "upper_bound"}
    out = []
    for r in rows:
        bound = ub.get(key(r))
        # within a thousandth is level: two compiles of the same work (tp 1, where no scheme
        # has an all-reduce) differ by a fusion or two, not by a scheme
        if bound is None or r is bound or r["tokens_per_s"] <= bound["tokens_per_s"] * 1.001:
            out.append(r)
            continue
        less = [
            f"{what} {mine:.3g} vs {theirs:.3g}{unit}"
            for what, unit, mine, theirs in (
                (
                    "HBM",
                    " GB",
                    _per_token(r, "hbm_bytes") / 1e9,
                    _per_token(bound, "hbm_bytes") / 1e9,
                ),
                (
                    "compute",
                    " GFLOP",
                    _per_token(r, "flops") / 1e9,
                    _per_token(bound, "flops") / 1e9,
                ),
                (
                    "decode step",
                    " kernels",
                    r["decode_step_kernels_full"],
                    bound["decode_step_kernels_full"],
                ),
            )
            if mine < theirs * (1 - 1e-3)
        ]
        weights = (
            f"; the weights are {r['weights_bytes'] / 1e9:.3g} GB per GPU"
            if r.get("weights_bytes")
            else ""
        )
        note = (
            (
                f"{r['residual']} tp={r['tp']} batch={r['batch']} {r['link']}: predicted "
                f"{r['tokens_per_s'] / bound['tokens_per_s']:.2f}x upper_bound because its "
                f"compiled programs do less per GPU and token ("
                + ", ".join(less)
                + weights
                + "): XLA compiled the two differently; the residual scheme is not the cause"
            )
            if less
            else (
                f"{r['residual']} tp={r['tp']} batch={r['batch']} {r['link']}: predicted above "
                f"upper_bound with no less work: a costing defect, please report it"
            )
        )
        out.append({**r, "above_upper_bound": note})
    return out


def _per_token(row: dict, what: str) -> float:
    """`what` (hbm_bytes, flops) per GPU per generated token: the prefill and every decode
    step of a generation, over its tokens."""
    n = row["new_tokens"]
    return (row[f"prefill_{what}"] + (n - 1) * row[f"decode_step_{what}"]) / n


JAX_POOL_FRACTION = 0.75  # the share of a GPU's memory jax's allocator takes by default


def pool_fraction() -> float:
    """The share of each GPU's memory the decoding process's allocator may use:
    XLA_PYTHON_CLIENT_MEM_FRACTION as set in this shell (export it as the GPU processes will
    have it), else jax's default, 0.75."""
    v = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        f = float(v) if v else JAX_POOL_FRACTION
    except ValueError:
        f = math.nan  # refused below with the out-of-range values
    if not 0 < f <= 1:
        raise PredictError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={v!r}: a number in (0, 1]")
    return f


def _device_bytes(x) -> int:
    """Bytes one device holds of a ShapeDtypeStruct carrying its sharding."""
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


@functools.lru_cache(maxsize=64)
def _weight_bytes(config, tp: int, target: str, hosts: int) -> int:
    """Bytes per device of the weights `decode` and `serve` decode with: the model with its
    input projections fused in place (`fuse_inputs`), from shapes."""
    from flax import nnx

    from ladder_jax.model.transformer import abstract, fuse_inputs

    mesh = programs.gpu_mesh(target, tp, hosts=hosts)
    fused = fuse_inputs(nnx.merge(*abstract(config, mesh)))
    return sum(_device_bytes(x) for x in jax.tree.leaves(nnx.state(fused)))


def decode_memory(
    config,
    *,
    tp: int,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    target: str,
    hosts: int = 1,
    slots: int | None = None,
) -> dict:
    """What `decode` and `serve` hold per GPU of `target` (bytes): the weights as they decode
    with them (input projections fused in place; int8 weights as stored) and the KV cache
    sized for prompt + new tokens (or `slots` per row), against the pool jax's allocator takes
    (`pool_fraction` of the chip's memory). The programs' temporaries (prefill activations,
    logits) are not counted. (`lj.generate(model)` from Python keeps the model too, so it
    holds the fused copy beside it, or decodes unfused where that copy would crowd the
    memory.)"""
    from ladder_jax.inference import generation

    weights = _weight_bytes(config, tp, target, hosts)
    cache = generation.KVCache.abstract(
        config,
        programs.gpu_mesh(target, tp, hosts=hosts),
        batch,
        slots or generation.cache_length(config, prompt_len, new_tokens),
    )
    kv = sum(_device_bytes(x) for x in (*cache.k, *cache.v))
    capacity = hardware.CHIPS[target].memory_bytes
    pool = int(pool_fraction() * capacity)
    return {
        "weights_bytes": weights,
        "kv_cache_bytes": kv,
        "memory_per_gpu_bytes": weights + kv,
        "device_pool_bytes": pool,
        "device_memory_bytes": capacity,
        "fits": weights + kv <= pool,
    }


def _compiled(name, fn):
    """Runs `fn`; a compiler failure becomes one PredictError naming the model."""
    try:
        return fn()
    except programs.CompileError as e:
        raise PredictError(f"{name or 'the model'}: {e}") from None


def predict_train(
    config,
    sweep: Sweep | None = None,
    *,
    batch: int,
    seq_len: int,
    grad_accum: int = 1,
    jobs: int | None = None,
    progress=None,
    name: str | None = None,
    efficiency: hardware.Efficiency | None = None,
    link_overrides: dict | None = None,
    **fields,
) -> list[dict]:
    """One row per (tp, residual, link) for a training step of `batch` sequences of
    `seq_len` tokens, `grad_accum` times (see the module doc)."""
    sweep = _sweep(sweep, efficiency, link_overrides, batch=(batch,), prompt_len=seq_len, **fields)
    sweep.check(config, phase="train")
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise PredictError(f"grad_accum={grad_accum!r} must be a positive integer")
    programs.check_plugin()
    cases = _cases(sweep, config)  # the sweep's batch is (batch,)
    shape = dict(prompt_len=seq_len, new_tokens=1, target=sweep.target)
    _compile_cases(name, sweep, cases, ("train",), shape, jobs, progress)
    rows = []
    for t, b, cfg in cases:
        for link_name in sweep.links:
            step = program_time(
                cfg, phase="train", tp=t, batch=b, **shape, **sweep.costing(t, link_name)
            )
            step_s = grad_accum * step["seconds"]
            rows.append(
                {
                    "phase": "train",
                    "residual": cfg.residual,
                    "ladder_layers": cfg.ladder_layers,
                    "tp": t,
                    "hosts": sweep.hosts_for(t),
                    "batch": batch,
                    "seq_len": seq_len,
                    "grad_accum": grad_accum,
                    "link": link_name,
                    "target": sweep.target,
                    "step_s": step_s,
                    "tokens_per_s": grad_accum * batch * seq_len / step_s,
                    "exposed_comm_s": grad_accum * step["exposed_comm_s"],
                    "compute_s": grad_accum * step["compute_s"],
                    "layers_compiled": step["layers_compiled"],
                    "n_layers": cfg.n_layers,
                    "fallback": step["fallback"],
                }
            )
    return rows


def _cases(sweep: Sweep, config) -> list[tuple]:
    """(tp, batch, config) of every cell of `sweep`, one config per residual scheme (the
    ladder keeps `config.ladder_layers`, the others have none)."""
    return [
        (
            t,
            b,
            dataclasses.replace(
                config, residual=r, ladder_layers=(config.ladder_layers if r == "ladder" else None)
            ),
        )
        for t in sweep.tp
        for b in sweep.batch
        for r in sweep.residuals
    ]


def _compile_cases(name, sweep: Sweep, cases, phases, shape: dict, jobs, progress) -> None:
    """Compiles every program the `cases` (`_cases`) need in `phases` (`compile_all`); a
    compiler failure is one PredictError naming the model."""
    tasks = [
        task
        for t, b, cfg in cases
        for task in _tasks(
            cfg,
            phases,
            compiled_depths(cfg, sweep.layers_compiled),
            tp=t,
            batch=b,
            hosts=sweep.hosts_for(t),
            **shape,
        )
    ]
    _compiled(name, lambda: compile_all(tasks, jobs, progress))


def _as_tuple(v) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,)


def _row(cfg, sweep: Sweep, tp, batch, link, pre, step) -> dict:
    new_tokens = sweep.new_tokens
    total = pre["seconds"] + (new_tokens - 1) * step["seconds"]
    tokens_per_s = batch * new_tokens / total
    hosts = sweep.hosts_for(tp)
    fallback = ",".join(sorted({f for f in (pre["fallback"], step["fallback"]) if f})) or None
    return {
        "residual": cfg.residual,
        "ladder_layers": cfg.ladder_layers,
        "tp": tp,
        "batch": batch,
        "prompt_len": sweep.prompt_len,
        "new_tokens": new_tokens,
        "link": link,
        "target": sweep.target,
        "hosts": hosts,
        "quantize": cfg.quantize,
        "inter_host": sweep.calibration.inter_host.name if hosts > 1 else None,
        "prefill_s": pre["seconds"],
        "decode_step_s": step["seconds"],
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_user": tokens_per_s / batch,
        "exposed_comm_s": pre["exposed_comm_s"] + (new_tokens - 1) * step["exposed_comm_s"],
        "prefill_exposed_comm_s": pre["exposed_comm_s"],
        "decode_step_exposed_comm_s": step["exposed_comm_s"],
        "decode_step_compute_s": step["compute_s"],
        "decode_step_kernels": step["kernels"],
        "layers_compiled": step["layers_compiled"],
        "decode_step_hbm_bytes": step["work"]["hbm_bytes"],
        "decode_step_flops": step["work"]["flops"],
        "decode_step_kernels_full": step["work"]["kernels"],
        "prefill_hbm_bytes": pre["work"]["hbm_bytes"],
        "prefill_flops": pre["work"]["flops"],
        "n_layers": cfg.n_layers,
        "contention": sweep.contention,
        "launch": sweep.launch,
        "copy_contention": sweep.contention and sweep.copy_contention,
        "stream_sync": sweep.stream_sync and sweep.launch != "off",
        "nccl_in_host": sweep.algorithm == "nccl" and sweep.nccl_in_host,
        "nvls": sweep.algorithm == "nccl" and sweep.nccl_in_host and sweep.nvls,
        "waves": sweep.contention and sweep.waves,
        "fallback": fallback,
        "slots": sweep.slots,
        "calibration": sweep.calibration.source,
    }


def with_ratios(rows: list[dict]) -> list[dict]:
    """Adds `vs_standard`: tokens/s over the standard row of the same link, tp and batch."""
    key = lambda r: (r["link"], r["tp"], r["batch"])  # noqa: E731
    std = {key(r): r["tokens_per_s"] for r in rows if r["residual"] == "standard"}
    return [
        {**r, "vs_standard": r["tokens_per_s"] / std[key(r)] if key(r) in std else None}
        for r in rows
    ]


def format_train_table(rows: list[dict]) -> str:
    lines = [
        f"{'link':<7} {'tp':>3} {'residual':<12} {'step ms':>10} {'exposed ms':>10} "
        f"{'tokens/s':>10} {'vs standard':>11}"
    ]
    for r in with_ratios(rows):
        ratio = "-" if r["vs_standard"] is None else f"{r['vs_standard']:.3f}x"
        lines.append(
            f"{r['link']:<7} {r['tp']:>3} {r['residual']:<12} {r['step_s'] * 1e3:>10.1f} "
            f"{r['exposed_comm_s'] * 1e3:>10.1f} {r['tokens_per_s']:>10.0f} {ratio:>11}"
        )
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'link':<7} {'tp':>3} {'batch':>5} {'residual':<12} {'prefill ms':>10} "
        f"{'decode ms/tok':>13} {'exposed ms/tok':>14} {'tokens/s':>10} "
        f"{'tok/s/user':>10} {'vs standard':>11} {'GiB/GPU':>7}"
    ]
    order = {name: i for i, name in enumerate(hardware.LINKS)}
    rows = sorted(with_ratios(rows), key=lambda r: (order.get(r["link"], 99), r["tp"], r["batch"]))
    for r in rows:
        ratio = "-" if r["vs_standard"] is None else f"{r['vs_standard']:.3f}x"
        mem = (
            ""
            if "memory_per_gpu_bytes" not in r
            else f" {r['memory_per_gpu_bytes'] / 2**30:>7.1f}"
            + ("" if r["fits"] else " does not fit")
        )
        lines.append(
            f"{r['link']:<7} {r['tp']:>3} {r['batch']:>5} {r['residual']:<12} "
            f"{r['prefill_s'] * 1e3:>10.1f} {r['decode_step_s'] * 1e3:>13.3f} "
            f"{r['decode_step_exposed_comm_s'] * 1e3:>14.3f} "
            f"{r['tokens_per_s']:>10.1f} {r['tokens_per_s_per_user']:>10.1f} "
            f"{ratio:>11}{mem}"
        )
    return "\n".join(lines)


def memory_note(rows: list[dict]) -> str:
    """What the GiB/GPU column counts, and what its flag means when a row has it."""
    first = next((r for r in rows if "device_pool_bytes" in r), None)
    if first is None:
        return ""
    chip, pool = hardware.CHIPS[first["target"]], first["device_pool_bytes"]
    note = (
        f"GiB/GPU: weights (input projections fused in place) + KV cache per GPU, "
        f"temporaries not counted; jax's pool on the {chip.name} is {pool / 2**30:.1f} GiB "
        f"({pool / chip.memory_bytes:.2f} of {chip.memory_bytes / 2**30:.1f} GiB: "
        f"XLA_PYTHON_CLIENT_MEM_FRACTION)"
    )
    if any(not r["fits"] for r in rows if "fits" in r):
        note += (
            "\ndoes not fit: more than the pool; more GPUs (--tp), a shorter cache, int8, "
            "or a larger XLA_PYTHON_CLIENT_MEM_FRACTION"
        )
    return note


def summary(rows: list[dict]) -> str:
    """ladder/standard and upper_bound/standard, one line per link, tp and batch."""
    out = []
    order = {name: i for i, name in enumerate(hardware.LINKS)}
    for r in sorted(with_ratios(rows), key=lambda r: order.get(r["link"], 99)):
        if r["residual"] in ("ladder", "upper_bound") and r["vs_standard"] is not None:
            out.append((r["link"], r["tp"], r["batch"], r["residual"], r["vs_standard"]))
    by = {}
    for link, tp, b, res, v in out:
        by.setdefault((link, tp, b), {})[res] = v
    return "\n".join(
        f"{link} tp={tp} batch={b}: " + ", ".join(f"{k}/standard {v:.3f}" for k, v in d.items())
        for (link, tp, b), d in by.items()
    )


def check_calibration(cal: hardware.Calibration) -> None:
    """Every figure finite and in range: one line naming the figure."""
    eff = cal.efficiency
    for name, v in (("gemm efficiency", eff.gemm), ("memory efficiency", eff.memory)):
        if not (math.isfinite(v) and 0 < v <= 1):
            raise PredictError(f"{name} {v} must be in (0, 1]")
    if not (math.isfinite(eff.kernel_overhead_s) and eff.kernel_overhead_s >= 0):
        raise PredictError(
            f"kernel overhead {eff.kernel_overhead_s * 1e6:g} us must be a finite number >= 0"
        )
    for link in [*cal.links.values(), cal.inter_host]:
        for k in ("base_latency_s", "hop_latency_s", "bus_bytes_per_s"):
            v = getattr(link, k)
            if not math.isfinite(v) or v < 0 or (k == "bus_bytes_per_s" and v == 0):
                raise PredictError(
                    f"link {link.name} {k}={v} must be a finite number "
                    f"{'> 0' if k == 'bus_bytes_per_s' else '>= 0'}"
                )
    if not (math.isfinite(cal.contention.copy_rate) and 0 < cal.contention.copy_rate <= 1):
        raise PredictError(f"contention copy_rate={cal.contention.copy_rate} must be in (0, 1]")
    for f in dataclasses.fields(cal.launch):
        v = getattr(cal.launch, f.name)
        if f.name != "sources" and not (math.isfinite(v) and v >= 0):
            raise PredictError(f"launch {f.name}={v} must be a finite number >= 0")
    for k in ("bf16_flops", "hbm_bytes_per_s"):
        v = getattr(cal.chip, k)
        if not math.isfinite(v) or v <= 0:
            raise PredictError(f"chip {k}={v} must be a finite number > 0")


def check_knobs(eff: hardware.Efficiency, link_overrides: dict) -> None:
    """The command line's figures (efficiencies, link overrides): one line naming the flag."""
    for name, v in (("gemm efficiency", eff.gemm), ("memory efficiency", eff.memory)):
        if not (math.isfinite(v) and 0 < v <= 1):
            raise PredictError(f"{name} {v} must be in (0, 1]")
    if not (math.isfinite(eff.kernel_overhead_s) and eff.kernel_overhead_s >= 0):
        raise PredictError("--kernel-overhead-us must be a finite number >= 0")
    flags = {
        "base_latency_s": "--link-latency-us",
        "hop_latency_s": "--link-hop-us",
        "bus_bytes_per_s": "--link-busbw-gbs",
    }
    for k, v in link_overrides.items():
        if not math.isfinite(v) or v < 0 or (k == "bus_bytes_per_s" and v == 0):
            raise PredictError(
                f"{flags.get(k, k)} {v:g}: must be a finite number "
                f"{'> 0' if k == 'bus_bytes_per_s' else '>= 0'}"
            )


# ---------------------------------------------------------------------------------------------
# The most a schedule can hide: each module's all-reduce behind the next module's compute.


def module_times(ops, layer: int) -> dict:
    """Compute and all-reduce seconds of each module of `layer` in a costed program (`costed`
    ops of a schedule whose modules each end in their all-reduce, e.g. the standard scheme):
    `compute_s[i]` sums the seconds of the layer's compute kernels after its i-th collective
    and up to its (i + 1)-th, `collective_s[i]` that collective's seconds. Compute after the
    last collective counts to the first module (the next layer's order); a layer without
    collectives is one module whose all-reduce takes 0 s. An op without a layer (XLA fuses
    some of a layer's kernels, e.g. its cache updates, into fusions it names no layer for)
    counts to the layer of the op before it.

        module_times(costed(kernels, calibration=cal, link=link), layer=3)

    Invariant: sum(compute_s) is the layer's compute kernels' seconds."""
    compute, collective = [0.0], []
    current = None  # the layer of the last op that has one
    for op in ops:
        current = op.layer if op.layer is not None else current
        if current != layer:
            continue
        if op.kind == "compute":
            compute[-1] += op.seconds
        elif op.kind in ("start", "sync"):
            collective.append(op.seconds)
            compute.append(0.0)
    if not collective:
        return {"compute_s": compute, "collective_s": [0.0]}
    compute[0] += compute.pop()
    return {"compute_s": compute, "collective_s": collective}


def overlap_bound(
    compute_s, collective_s, wait_s: float = 0.0, layers: int = 64, one_in_flight: bool = False
) -> dict:
    """The best any schedule of a stack of modules can do where module i's all-reduce
    (`collective_s[i]`) can hide only behind module i + 1's compute (`compute_s[i + 1]`; the
    last module's behind the next layer's first: one layer repeated `layers` times), as the
    ladder hides it: module j starts once module j - 1's compute and module j - 2's
    all-reduce are done, its all-reduce once its compute is done and the one before it has
    finished (one collective stream), each cross-stream handover `wait_s` late
    (`hardware.Launch.stream_sync_s`). Returns `serial_s` (a layer with every all-reduce
    exposed: standard), `best_s` (a layer of that schedule, in steady state), `best_exposed_s`
    (best_s less the compute) and `bound` = serial_s / best_s.

    `one_in_flight`: the best such schedule where no two collectives over the same GPUs are
    in flight together, as XLA:GPU's latency-hiding scheduler orders them (it never starts a
    collective while one sharing more than one rank with it is in flight): module j's
    all-reduce starts only after the compute stream has waited for module j - 1's, so each
    module runs its kernels, waits for the previous all-reduce (done j - 1), then starts its
    own. Each all-reduce then begins two handovers after the previous one ended, not as soon
    as the collective stream is free.

        overlap_bound([20e-6, 10e-6], [15e-6, 15e-6])   # best 35e-6: bound 60 / 35
        overlap_bound([14.0, 11.0], [15.0, 15.0], wait_s=2.0, one_in_flight=True)  # best 38

    With `wait_s` 0 and two modules, best_s = max(C[1], A[0]) + max(C[0], A[1]) either way.
    Invariants: 1 <= bound <= 2 where `wait_s` is 0; the one-in-flight best_s is never below
    the unconstrained one."""
    c, a = list(compute_s), list(collective_s)
    if len(c) != len(a) or not c:
        raise ValueError(f"overlap_bound: {len(c)} compute times for {len(a)} collectives")
    n = len(c)
    now, ended = 0.0, []  # the compute stream's clock; each all-reduce's end
    for j in range(layers * n):
        if one_in_flight:  # kernels j, done j - 1, start j
            now += c[j % n]
            if j >= 1:
                now = max(now, ended[j - 1] + wait_s)
            start = now + wait_s
        else:  # kernels j (after done j - 2), start j, done j - 1
            now = max(now, ended[j - 2] + wait_s if j >= 2 else 0.0) + c[j % n]
            start = max(now + wait_s, ended[j - 1] if j >= 1 else 0.0)
        ended.append(start + a[j % n])
    serial = sum(c) + sum(a)
    best = ended[-1] - ended[-1 - n]
    return {
        "serial_s": serial,
        "best_s": best,
        "best_exposed_s": max(0.0, best - sum(c)),
        "bound": serial / best if best > 0 else 1.0,
    }
