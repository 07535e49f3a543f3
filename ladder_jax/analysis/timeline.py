"""The timeline simulation: kernels timed (`costed`), then the compute and collective streams
replayed as XLA scheduled them (`simulate`); `extended` carries a short replay to full depth,
`overlap_bound` is the most any schedule could hide (docs/analysis.md, 'Predict the speed-up').

    t = simulate(costed(kernels, calibration=cal, link=cal.links["nvlink"]), step_s=...)"""

from __future__ import annotations

import dataclasses
import math

from ladder_jax import hardware
from ladder_jax.analysis.collectives import bus_bytes, time_collective
from ladder_jax.analysis.kernels import Kernel, PredictError


def kernel_seconds(k: Kernel, chip: hardware.Chip, eff: hardware.Efficiency) -> float:
    """Roofline of one compute kernel plus the fixed per-kernel overhead."""
    flops_s, bytes_s = _roofline(k, chip, eff)
    return max(flops_s, bytes_s) + eff.kernel_overhead_s


def _roofline(k: Kernel, chip, eff) -> tuple[float, float]:
    return k.flops / (chip.bf16_flops * eff.gemm), k.nbytes / (chip.hbm_bytes_per_s * eff.memory)


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
            s, lat, how = time_collective(
                k, link=link, calibration=cal, algorithm=algorithm, in_host=in_host, nvls=nvls
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
    shallow: Timeline, deep: Timeline, n_layers: int, deep_layers: int, period: int = 1
) -> tuple[float, float]:
    """(seconds, compute seconds) at `n_layers`, from timelines of `deep_layers - period` and
    `deep_layers` layers: each missing period of layers adds their difference."""
    extra = (n_layers - deep_layers) // period
    return (
        deep.seconds + extra * (deep.seconds - shallow.seconds),
        deep.compute_s + extra * (deep.compute_s - shallow.compute_s),
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
