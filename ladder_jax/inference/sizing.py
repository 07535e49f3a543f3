"""How big a server's KV cache is: slots x positions fitted to a share of the memory left once
the weights are loaded (`--memory-fraction`). Pure arithmetic on the config, no device work.

    plan = plan_kv(config, tp=1, slots=16, max_len=None, free=24 << 30, fraction=0.5)
    plan.slots, plan.positions, plan.kv_bytes, plan.line()

Positions are cut first (to a multiple of POSITION_STEP), then slots, never below one slot of
POSITION_STEP positions; a flag the user gave is never cut (too big: a SizingError naming it).
The table of what the defaults choose: docs/inference.md, 'Serve'."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ladder_jax.config import ConfigError, ModelConfig
from ladder_jax.model import layout

POSITION_STEP = 64  # positions are cut to a multiple of this
DEFAULT_FRACTION = {"cpu": 0.5, "gpu": 0.8}  # of the memory left after the weights
FLAG = "--memory-fraction"


class SizingError(ConfigError):
    """The KV cache the flags ask for does not fit (one line naming the flags)."""


def position_bytes(config: ModelConfig, tp: int, devices: int = 1) -> int:
    """Bytes one slot's position takes in the cache (its k and v in every layer) on `devices`
    of the tp devices together: 1 for a GPU's own memory, the host's local devices on CPU."""
    heads = layout.cache_kv_heads(config, tp) // tp  # a device's share of the kv heads
    itemsize = jnp.dtype(config.dtype).itemsize
    return 2 * config.n_layers * heads * config.head_dim * itemsize * devices


def check_fraction(fraction: float) -> float:
    if not 0 < fraction <= 1:
        raise ConfigError(f"{FLAG} {fraction:g}: a share of the free memory, 0 < F <= 1")
    return fraction


@dataclasses.dataclass(frozen=True)
class KVPlan:
    slots: int
    positions: int
    kv_bytes: int  # slots x (positions + spare) x position_bytes, in the memory `free` counts
    free: int | None  # bytes free after loading the weights (None: unknown, nothing cut)
    fraction: float
    where: str  # "of host memory" or "on each device"
    why: str  # what was cut, or that the request fits

    def line(self) -> str:
        """One start-up line: what was chosen, from what memory, and why."""
        kv = f"{size_text(self.kv_bytes)} {self.where}"
        if self.free is None:
            return f"KV cache: {self.slots} slots x {self.positions:,} positions, {kv} ({self.why})"
        return (
            f"KV cache: {self.slots} slots x {self.positions:,} positions, {kv}: {self.why} "
            f"({FLAG} {self.fraction:g} of {size_text(self.free)} free after the weights)"
        )


def size_text(n: float) -> str:
    """Bytes in GiB, MiB or KiB, whichever keeps a digit before the point."""
    for shift, unit in ((30, "GiB"), (20, "MiB")):
        if n >= 2**shift:
            return f"{n / 2**shift:,.1f} {unit}"
    return f"{n / 2**10:,.1f} KiB"


def plan_kv(
    config: ModelConfig,
    tp: int,
    *,
    slots: int,
    max_len: int | None,
    free: int | None,
    fraction: float,
    devices: int = 1,
    spare: int = 0,
    slots_given: bool = False,
    where: str = "of host memory",
) -> KVPlan:
    """The cache's slots and positions: `slots` x (`max_len` or the model's max_seq_len) when it
    fits in `fraction` x `free` bytes, else positions cut (unless `max_len` was given), then
    slots (unless `slots_given`), each to what fits; SizingError when even one slot of
    POSITION_STEP positions (or of the given --max-len) does not. Each row also holds `spare`
    positions no request uses (an engine's scratch tail), counted in the bytes."""
    check_fraction(fraction)
    per = position_bytes(config, tp, devices)
    want = min(max_len or config.max_seq_len, config.max_seq_len)
    need = lambda s, n: s * (n + spare) * per  # noqa: E731
    plan = lambda s, n, why: KVPlan(s, n, need(s, n), free, fraction, where, why)  # noqa: E731
    if free is None:
        return plan(slots, want, f"free memory unknown: not sized, {FLAG} unused")
    budget = int(fraction * free)
    if need(slots, want) <= budget:
        return plan(slots, want, "fits" if max_len else "the model's max_seq_len fits")
    asked = f"{slots} slots x {want:,} positions need {size_text(need(slots, want))} {where}"
    room = f"{FLAG} {fraction:g} of {size_text(free)} free is {size_text(budget)}"
    if max_len is None:  # positions first, to a multiple of the step
        n = (budget // (slots * per) - spare) // POSITION_STEP * POSITION_STEP
        if n >= POSITION_STEP:
            return plan(slots, n, f"positions cut to fit ({asked}; give --max-len to choose)")
    n = max_len or POSITION_STEP
    s = budget // ((n + spare) * per)
    if not slots_given and s >= 1:
        return plan(int(s), n, f"slots cut to fit ({asked}; give --slots to choose)")
    least = slots if slots_given else 1
    fixes = ["lower --max-len"] if max_len else []
    fixes += ["lower --slots"] if least > 1 else []
    fixes += [f"raise {FLAG}", "use a smaller model or more devices"]
    raise SizingError(
        f"no room for a KV cache of {least} slot(s) x {n:,} positions "
        f"({size_text(need(least, n))} {where}): {room}; {', '.join(fixes)}"
    )
