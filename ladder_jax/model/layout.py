"""Mesh and layout: the (data, tp) mesh, every weight's partition spec (`WeightSpecs`), the KV
cache's (`CACHE_BKSH`), the divisibility checks. The table: docs/architecture.md, 'Where
weights live: stored vs tp specs'.

    mesh = make_mesh(tp=4, data=2); specs = WeightSpecs.for_model(config, mesh)"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from ladder_jax import runtime
from ladder_jax.config import ConfigError

DATA = "data"
TP = "tp"


class ShardingError(ConfigError):
    """A model/mesh combination that cannot be sharded; the message says how to fix it."""


def make_mesh(tp: int | None = None, data: int | None = None, *, devices=None) -> Mesh:
    """A (data, tp) mesh over `devices` (default: all of them, on every process).

    With neither size given, all devices go to `tp`. With one given, the other takes the rest.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if tp is None and data is None:
        tp, data = n, 1
    elif tp is None:
        if data <= 0 or n % data:
            raise ShardingError(f"data={data} does not divide the {n} available devices")
        tp = n // data
    elif data is None:
        if tp <= 0 or n % tp:
            raise ShardingError(
                f"tp={tp} does not divide the {n} available devices: use a divisor of {n}"
            )
        data = n // tp
    if tp <= 0 or data <= 0 or tp * data != n:
        raise ShardingError(
            f"data={data} x tp={tp} = {data * tp} devices, but {n} are available: "
            f"choose sizes whose product is {n}"
        )
    grid = np.array(devices, dtype=object).reshape(data, tp)
    return Mesh(grid, (DATA, TP), axis_types=(AxisType.Auto, AxisType.Auto))


def tp_mesh(tp: int, *, flag: str = "--tp", say=None) -> Mesh:
    """A (1, tp) mesh of the first `tp` devices, for inference: the others stay idle rather
    than becoming data-parallel copies of the model. With several processes the model spans
    them all (`make_mesh(tp=tp)`). `say` (e.g. a stderr printer) gets one note line when
    devices are left unused; `flag` names the setting in that note and in errors.

        mesh = tp_mesh(2, say=note)   # 8 devices: runs on devices 0 and 1, says 6 are unused"""
    devices = jax.devices()
    n = len(devices)
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= n:
        raise ShardingError(f"{flag} {tp!r}: between 1 and the {n} devices")
    if jax.process_count() > 1:
        return make_mesh(tp=tp)
    if say is not None and tp < n:
        say(f"note: {flag} {tp} runs on {tp} of the {n} devices; the other {n - tp} are unused")
    return make_mesh(tp=tp, data=1, devices=devices[:tp])


def tp_size(mesh: Mesh) -> int:
    return mesh.shape[TP]


def data_size(mesh: Mesh) -> int:
    return mesh.shape[DATA]


@dataclasses.dataclass(frozen=True)
class WeightSpecs:
    """Partition spec of every weight, by einsum shape (docs/architecture.md)."""

    embed_vd: P
    head_dv: P
    q_dnh: P
    kv_dkh: P
    o_nhd: P
    up_df: P  # gate and up
    down_fd: P
    norm_d: P
    kv_replicated: bool  # True when n_kv_heads < tp: each rank picks its head locally
    fsdp_data: int = 1  # FSDP: weights stored split over `data` too (its size; 1 = off)

    @classmethod
    def for_model(cls, config, mesh: Mesh, *, fsdp: bool = False) -> "WeightSpecs":
        """Validates that `config` can be split `tp` ways and returns its layout."""
        tp = tp_size(mesh)
        check_divisible(config, tp)
        kv_replicated = config.n_kv_heads < tp
        return cls(
            fsdp_data=data_size(mesh) if fsdp else 1,
            embed_vd=P(None, None),
            head_dv=P(None, TP),
            q_dnh=P(None, TP, None),
            kv_dkh=P(None, None, None) if kv_replicated else P(None, TP, None),
            o_nhd=P(TP, None, None),
            up_df=P(None, TP),
            down_fd=P(TP, None),
            norm_d=P(None),
            kv_replicated=kv_replicated,
        )

    @staticmethod
    def fsdp(spec: P, shape, n_data: int) -> P:
        """Where a weight is *stored* under FSDP (`mesh.fsdp`): its tp spec with the largest
        still-unsplit dimension that `n_data` divides also split over `data` (unchanged when
        none is). Its Adam moments follow it. The model's shard_map takes each weight in this
        layout and all-gathers it over `data` where a module reads it (`read_weight`), so only
        the weights of the module at work (and of the ones whose gathers are in flight) are
        whole on a rank; the gradient of the gather reduce-scatters the weight's gradient."""
        entries = list(spec) + [None] * (len(shape) - len(spec))
        free = [i for i, e in enumerate(entries) if e is None and shape[i] % n_data == 0]
        if n_data == 1 or not free:
            return spec
        entries[max(free, key=lambda i: shape[i])] = DATA
        return P(*entries)


# KV cache, per layer keys of global shape (B, K', H, S) and values (B, K', S, H), K' = max(K,
# tp): batch over `data`, kv heads over `tp`. With K < tp each rank caches the one kv head its
# query heads use, so ranks that share a head hold identical copies (the cache then costs tp/K
# times the unsharded size). Heads before slots, and keys with slots last: the decode step's
# two attention products are then plain matmuls batched over (B, K) that read each head's
# block as it lies: q (G, H) x keys (H, S), probabilities (G, S) x values (S, H). Stored
# (B, S, K, H), XLA copied the whole cache into that order and back in every layer of every
# step wherever a rank holds several kv heads (measured: docs/results.md, CPU decoding).
CACHE_BKSH = P(DATA, TP, None, None)
# The paged cache (`ladder_jax.model.paged`, a server's: data = 1, so `data` splits nothing):
# pools of pages (P, K', H, page) and (P, K', page, H), kv heads over `tp` as above; the block
# table (B, M).
POOL_PKHS = P(DATA, TP, None, None)
TABLE_BM = P(DATA, None)


def cache_specs(layers) -> list[tuple]:
    """The shard_map specs of a cache's per-layer tuples: (k, v) rows or (k pool, v pool,
    table)."""
    return [
        (POOL_PKHS, POOL_PKHS, TABLE_BM) if len(kv) == 3 else (CACHE_BKSH, CACHE_BKSH)
        for kv in layers
    ]


def device_bytes(x) -> int:
    """Bytes one device holds of an array (or ShapeDtypeStruct) carrying its sharding."""
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def cache_kv_heads(config, tp: int) -> int:
    """The kv heads of the cache: max(K, tp); a desync model's max(K, desync_tp), every
    stream's own (`ladder_jax.model.desync`)."""
    if config.residual == "desync":
        return max(config.n_kv_heads, config.desync_tp or tp)
    return max(config.n_kv_heads, tp)


def check_divisible(config, tp: int, flag: str | None = None) -> None:
    """Every count split over `tp` must divide evenly; fail early, naming numbers and fixes.
    `flag` is what sets tp where the caller reads it (`--tp`, `mesh.tp`): the message then
    names it, with the largest tp below this one that fits."""
    try:
        _check_divisible(config, tp)
    except ShardingError as e:
        if flag is None:
            raise
        fit = largest_tp(config, min(tp, config.n_heads))  # no tp above the heads fits
        use = f"{flag} {fit}" if flag.startswith("-") else f"{flag}={fit}"
        raise ShardingError(f"{e} (set by {flag}; e.g. {use})") from None


def fits(config, tp: int) -> bool:
    """Whether `config` splits evenly over `tp` (`check_divisible` passes)."""
    try:
        _check_divisible(config, tp)
    except ShardingError:
        return False
    return True


def largest_tp(config, limit: int) -> int:
    """The largest tp <= `limit` that `config` splits over evenly; 1 always does."""
    return max(t for t in range(1, max(1, limit) + 1) if fits(config, t))


def default_tp(
    config,
    devices: int,
    *,
    backend: str | None = None,
    cores: int | None = None,
    flag: str = "--tp",
) -> tuple[int, str]:
    """(tp, why) when the user named none: the largest tp that `config` splits over and that
    does not exceed `devices`, nor on a CPU backend half this host's cores (fake devices share
    the cores, and XLA:CPU runs each device's matmuls on several threads: a tp of all the
    cores only adds collectives). `why` is one line for stderr.

        tp, why = default_tp(config, len(jax.devices()))   # 1 on a 2-core host"""
    backend = backend or jax.default_backend()
    limit, over = devices, f"the {devices} device(s)"
    if backend == "cpu":
        cores = runtime.cpu_cores() if cores is None else cores
        if max(1, cores // 2) <= devices:
            limit, over = max(1, cores // 2), f"half this host's {cores} CPU core(s)"
    tp = largest_tp(config, limit)
    return tp, (
        f"tp={tp}: the largest that splits the model's {config.n_heads} heads "
        f"({config.n_kv_heads} kv heads) and fits {over} ({flag} to choose)"
    )


def _check_divisible(config, tp: int) -> None:
    if config.n_heads % tp:
        raise ShardingError(
            f"n_heads={config.n_heads} is not divisible by tp={tp}: use a tp that divides "
            f"{config.n_heads}"
        )
    k = config.n_kv_heads
    if k >= tp and k % tp:
        raise ShardingError(
            f"n_kv_heads={k} is not divisible by tp={tp}: use a tp that divides {k}, or a "
            f"multiple of {k} (kv heads are then replicated)"
        )
    if k < tp and tp % k:
        fits = sorted(
            d
            for d in range(1, config.n_heads + 1)
            if config.n_heads % d == 0 and (d % k == 0 or k % d == 0)
        )
        raise ShardingError(
            f"n_kv_heads={k} < tp={tp} and {k} does not divide {tp}: kv heads can only be "
            f"replicated when tp is a multiple of n_kv_heads; use tp in "
            f"{fits}"
        )
    if config.d_ff % tp:
        raise ShardingError(
            f"d_ff={config.d_ff} is not divisible by tp={tp}: use a tp that divides {config.d_ff}"
        )
    if config.vocab_size % tp:
        pad = -(-config.vocab_size // tp) * tp
        raise ShardingError(
            f"vocab_size={config.vocab_size} is not divisible by tp={tp} (the LM head is split "
            f"over the vocabulary): pad vocab_size to {pad}"
        )


def check_batch(batch: int, mesh: Mesh) -> None:
    d = data_size(mesh)
    if batch % d:
        raise ShardingError(
            f"batch size {batch} is not divisible by the data axis ({d}): use a multiple of {d}"
        )
