"""Predict tokens/s of each residual scheme on GPUs you do not have, from the schedule XLA
compiles: programs (`compiled`) -> kernels (`kernels`) -> kernels and collectives timed
(`collectives`) -> streams replayed (`timeline`) -> rows (`predict`, printed by `tables`).
Method, calibration and limits: docs/analysis.md, 'Predict the speed-up'.

    rows = lj.predict("llama-3-70b", tp=[2, 4, 8])   # python -m ladder_jax.predict ..."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import time

import jax
from flax import nnx

from ladder_jax import hardware
from ladder_jax.analysis import programs, roofline
from ladder_jax.analysis.collectives import ALGORITHMS
from ladder_jax.analysis.compiled import (
    Program,
    Workload,
    check_layers_compiled,
    compile_all,
    compiled_depths,
    program_kernels,
    tasks,
    work,
)
from ladder_jax.analysis.kernels import PredictError
from ladder_jax.analysis.timeline import costed, extended, simulate, stream_waits
from ladder_jax.config import REDUCE_PATTERNS, RESIDUALS, SCHEMES, ConfigError
from ladder_jax.inference import generation
from ladder_jax.model import layout
from ladder_jax.model.compilation import check_allreduce
from ladder_jax.model.layout import device_bytes
from ladder_jax.model.transformer import abstract, fuse_inputs


@dataclasses.dataclass(frozen=True)
class Costing:
    """How a compiled program is costed: `link` within a host and `calibration` (None: the
    public figures of the workload's target, `hardware.calibration`); `layers_compiled`: the
    depth compiled and extended to full depth (`compiled_depths`); `algorithm`: how
    collectives are timed ("nccl", "ring", "tree"; `time_collective`); `launch`: how the host
    issues the kernels (`launch_plan`: "graphs", "streams", or "off" to leave the host out).
    The model's switches, each True by default, False for its ablation: `contention`
    (collectives in flight take SMs and HBM from the kernels beside them), `copy_contention`
    (and their copies slow down beside a running kernel, `hardware.Contention.copy_rate`),
    `stream_sync` (asynchronous collectives pay the device's cross-stream waits,
    `stream_waits`; not with launch "off"), `in_host` and `nvls` (NCCL's choice within a host,
    NVLS among it), `waves` (wave quantization of GEMMs beside a collective,
    `flops_slowdown`)."""

    link: hardware.Link
    calibration: hardware.Calibration | None = None
    layers_compiled: int = 4
    algorithm: str = "nccl"
    launch: str = "graphs"
    contention: bool = True
    copy_contention: bool = True
    stream_sync: bool = True
    in_host: bool = True
    nvls: bool = True
    waves: bool = True


def program_time(config, workload: Workload, costing: Costing, *, phase: str) -> dict:
    """Predicted seconds, compute seconds, exposed communication, compute kernels and work
    (`work`, extended to full depth) of `config`'s `phase` program for `workload`, costed as
    `costing` says (replayed by `simulate`)."""
    c = costing
    cal = c.calibration or hardware.calibration(workload.target)
    depths = compiled_depths(config, c.layers_compiled)
    timelines, program, works, fallbacks = [], Program(()), [], set()
    for depth in depths:
        program = program_kernels(
            dataclasses.replace(config, n_layers=depth), workload, phase=phase
        )
        fallbacks.add(program.fallback)
        works.append(work(program.kernels))
        ops = costed(
            program.kernels,
            calibration=cal,
            link=c.link,
            algorithm=c.algorithm,
            contention=c.contention,
            launch=c.launch,
            in_host=c.in_host,
            nvls=c.nvls,
            waves=c.waves,
        )
        if c.stream_sync and c.launch != "off":
            ops = stream_waits(ops, cal.launch.stream_sync_s)
        copy_rate = cal.contention.copy_rate if c.contention and c.copy_contention else 1.0
        step_s = 0.0 if c.launch == "off" else cal.launch.step_s
        timelines.append(simulate(ops, step_s=step_s, copy_rate=copy_rate))
    if depths == [config.n_layers]:
        seconds, compute = timelines[0].seconds, timelines[0].compute_s
        done = works[0]
    else:  # the two depths can fuse a kernel differently: keep 0 <= exposed <= seconds
        period = depths[1] - depths[0]
        seconds, compute = extended(*timelines, config.n_layers, depths[1], period)
        compute = min(compute, seconds)
        extra = (config.n_layers - depths[1]) // period
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
    its tiles (`flops_slowdown`), else by the share of SMs taken. `reduce_patterns`: the
    rows of residual "desync", one per pattern (a name of `REDUCE_PATTERNS` or explicit
    (attention, mlp) sync pairs), each with `desync_tp` the row's tp."""

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
    allreduces: tuple = ("nccl",)
    reduce_patterns: tuple = REDUCE_PATTERNS

    def __post_init__(self):
        for name in ("tp", "batch", "links", "residuals", "allreduces"):
            object.__setattr__(self, name, _as_tuple(getattr(self, name)))
        rp = self.reduce_patterns
        rp = (rp,) if isinstance(rp, str) else tuple(_pattern(p) for p in rp)
        object.__setattr__(self, "reduce_patterns", rp)
        if self.calibration is None and self.target in hardware.CHIPS:
            object.__setattr__(self, "calibration", hardware.calibration(self.target))

    def hosts_for(self, tp: int) -> int:
        return self.hosts if self.hosts is not None else max(1, -(-tp // self.gpus_per_host))

    def workload(self, tp: int, batch: int, allreduce: str = "nccl") -> Workload:
        """The request shape of this sweep's cell at `tp` and `batch`, its all-reduces run as
        `allreduce` says."""
        return Workload(
            tp=tp,
            batch=batch,
            prompt_len=self.prompt_len,
            new_tokens=self.new_tokens,
            target=self.target,
            hosts=self.hosts_for(tp),
            slots=self.slots,
            allreduce=allreduce,
        )

    def costing(self, link: str) -> Costing:
        """How this sweep costs a program on `link`:

        program_time(cfg, sweep.workload(8, 1), sweep.costing("nvlink"), phase="decode")
        """
        return Costing(
            link=self.calibration.links[link],
            calibration=self.calibration,
            layers_compiled=self.layers_compiled,
            algorithm=self.algorithm,
            launch=self.launch,
            contention=self.contention,
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
            if r not in SCHEMES:
                raise PredictError(
                    f"unknown residual {r!r}: choose one of {', '.join(SCHEMES)} or all"
                )
        for a in self.allreduces:
            _checked(lambda: check_allreduce(a, "allreduce"))
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
            layout.check_divisible(config, t)
            if "desync" in self.residuals:  # a pattern or tp desync cannot take: one line
                _scheme_configs(config, "desync", t, self.reduce_patterns)
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
    sweep = _sweep(sweep, efficiency, link_overrides, **fields)
    sweep.check(config)
    pool_fraction()  # a bad XLA_PYTHON_CLIENT_MEM_FRACTION before anything compiles
    programs.check_plugin()
    base = dataclasses.replace(
        config,
        max_seq_len=max(config.max_seq_len, sweep.slots or 0, sweep.prompt_len + sweep.new_tokens),
    )
    cases = _cases(sweep, base)
    _compile_cases(name, sweep, cases, ("prefill", "decode"), jobs, progress)
    rows, n, t0 = [], len(cases) * len(sweep.links) * len(sweep.allreduces), time.perf_counter()
    for (t, b, cfg), allreduce, link_name in itertools.product(
        cases, sweep.allreduces, sweep.links
    ):
        w = sweep.workload(t, b, allreduce)
        if progress:  # reading and costing each compiled program takes a while too
            k = len(rows)
            eta = (time.perf_counter() - t0) / k * (n - k) if k else None
            progress(k, n, eta, "costing")
        pre = program_time(cfg, w, sweep.costing(link_name), phase="prefill")
        step = program_time(cfg, w, sweep.costing(link_name), phase="decode")
        rows.append(
            {
                **_row(cfg, sweep, t, b, link_name, pre, step),
                "allreduce": allreduce,
                **context_length(config, base),
                **decode_memory(cfg, w),
                **roofline.roofline_fields(
                    cfg,
                    w,
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
    key = lambda r: (r["link"], r["tp"], r["batch"], r.get("allreduce"))  # noqa: E731
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
                f"{_scheme(r)} tp={r['tp']} batch={r['batch']} {r['link']}: predicted "
                f"{r['tokens_per_s'] / bound['tokens_per_s']:.2f}x upper_bound because its "
                f"compiled programs do less per GPU and token ("
                + ", ".join(less)
                + weights
                + "): XLA compiled the two differently; the residual scheme is not the cause"
            )
            if less
            else (
                f"{_scheme(r)} tp={r['tp']} batch={r['batch']} {r['link']}: predicted above "
                f"upper_bound with no less work: a costing defect, please report it"
            )
        )
        out.append({**r, "above_upper_bound": note})
    return out


def _scheme(row: dict) -> str:
    """The row's scheme, with its reduce pattern for desync."""
    rp = row.get("reduce_pattern")
    return (
        row["residual"]
        if rp is None
        else f"{row['residual']} {rp if isinstance(rp, str) else 'own pattern'}"
    )


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


@functools.lru_cache(maxsize=64)
def _weight_bytes(config, tp: int, target: str, hosts: int) -> int:
    """Bytes per device of the weights `decode` and `serve` decode with: the model with its
    input projections fused in place (`fuse_inputs`), from shapes."""
    mesh = programs.gpu_mesh(target, tp, hosts=hosts)
    fused = fuse_inputs(nnx.merge(*abstract(config, mesh)))
    return sum(device_bytes(x) for x in jax.tree.leaves(nnx.state(fused)))


def decode_memory(config, workload: Workload) -> dict:
    """What `decode` and `serve` hold per GPU of the workload's target (bytes): the weights as
    they decode with them (input projections fused in place; int8 weights as stored) and the
    KV cache sized for prompt + new tokens (or `slots` per row), against the pool jax's
    allocator takes (`pool_fraction` of the chip's memory). The programs' temporaries
    (prefill activations, logits) are not counted. (`lj.generate(model)` from Python keeps the
    model too, so it holds the fused copy beside it, or decodes unfused where that copy would
    crowd the memory.)"""
    w = workload
    weights = _weight_bytes(config, w.tp, w.target, w.hosts)
    cache = generation.KVCache.abstract(
        config,
        programs.gpu_mesh(w.target, w.tp, hosts=w.hosts),
        w.batch,
        w.slots or generation.cache_length(config, w.prompt_len, w.new_tokens),
    )
    kv = sum(device_bytes(x) for x in (*cache.k, *cache.v))
    capacity = hardware.CHIPS[w.target].memory_bytes
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
    sweep = dataclasses.replace(sweep, new_tokens=1, slots=None)
    cases = _cases(sweep, config)  # the sweep's batch is (batch,)
    _compile_cases(name, sweep, cases, ("train",), jobs, progress)
    rows = []
    for t, b, cfg in cases:
        for link_name in sweep.links:
            step = program_time(cfg, sweep.workload(t, b), sweep.costing(link_name), phase="train")
            step_s = grad_accum * step["seconds"]
            rows.append(
                {
                    "phase": "train",
                    "residual": cfg.residual,
                    "ladder_layers": cfg.ladder_layers,
                    **desync_fields(cfg),
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
    ladder keeps `config.ladder_layers`, the others have none) and, for desync, one per
    reduce pattern with `desync_tp` the cell's tp."""
    return [
        (t, b, cfg)
        for t in sweep.tp
        for b in sweep.batch
        for r in sweep.residuals
        for cfg in _scheme_configs(config, r, t, sweep.reduce_patterns)
    ]


def _scheme_configs(config, residual: str, tp: int, patterns: tuple) -> list:
    """`config` as `residual` at `tp`: one config, or desync's one per pattern."""
    keep = dict(reduce_pattern=None, desync_tp=None)
    if residual != "desync":
        ladder = config.ladder_layers if residual == "ladder" else None
        return [dataclasses.replace(config, residual=residual, ladder_layers=ladder, **keep)]
    try:
        return [
            dataclasses.replace(
                config, residual=residual, ladder_layers=None, reduce_pattern=p, desync_tp=tp
            )
            for p in patterns
        ]
    except ConfigError as e:
        raise PredictError(f"desync at tp={tp}: {e}") from None


def _pattern(p):
    """A reduce pattern as the config holds it: a name, or a tuple of (attention, mlp)."""
    return p if isinstance(p, str) else tuple(tuple(pair) for pair in p)


def desync_fields(cfg) -> dict:
    """A desync row's `reduce_pattern` (its name, or the (attention, mlp) pairs) and
    `desync_tp`; nothing for the other schemes, whose rows stay as they were."""
    if cfg.residual != "desync":
        return {}
    return {"reduce_pattern": cfg.reduce_pattern, "desync_tp": cfg.desync_tp}


def _compile_cases(name, sweep: Sweep, cases, phases, jobs, progress) -> None:
    """Compiles every program the `cases` (`_cases`) need in `phases` (`compile_all`); a
    compiler failure is one PredictError naming the model."""
    todo = [
        task
        for t, b, cfg in cases
        for a in sweep.allreduces
        for task in tasks(
            cfg, phases, compiled_depths(cfg, sweep.layers_compiled), sweep.workload(t, b, a)
        )
    ]
    _compiled(name, lambda: compile_all(todo, jobs, progress))


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
        **desync_fields(cfg),
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
