"""How big a server's KV cache is: a pool of pages of 16 positions fitted to a share of the
memory left once the weights are loaded (`--memory-fraction`), shared by the slots as their
requests grow. Pure arithmetic on the config, no device work.

    plan = plan_kv(config, tp=1, slots=16, max_len=None, free=24 << 30, fraction=0.5)
    plan.slots, plan.positions, plan.pages, plan.kv_bytes, plan.line()

The pool holds every slot at full length when that fits, else what fits (requests then share
it, the newest preempted when it runs out), but always one request at full length: when even
that does not fit, positions are cut (to a multiple of POSITION_STEP), unless --max-len was
given (then a SizingError naming the flags). The table of what the defaults choose:
docs/inference.md, 'Serve'."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ladder_jax.config import ConfigError, ModelConfig
from ladder_jax.model import layout
from ladder_jax.model.paged import PAGE

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
    positions: int  # the most a request may use (prompt + max_tokens)
    pages: int  # the pool's, the trash page included
    page: int
    kv_bytes: int  # pages x page x position_bytes, in the memory `free` counts
    free: int | None  # bytes free after loading the weights (None: unknown, nothing cut)
    fraction: float
    where: str  # "of host memory" or "on each device"
    why: str  # what was cut, or that the request fits

    @property
    def full_length(self) -> int:
        """Requests at `positions` the pool holds at once."""
        return (self.pages - 1) // -(-self.positions // self.page)

    def line(self) -> str:
        """One start-up line: what was chosen, from what memory, and why."""
        kv = (
            f"KV cache: {self.pages - 1:,} pages of {self.page} positions, "
            f"{size_text(self.kv_bytes)} {self.where}, for {self.slots} slots of up to "
            f"{self.positions:,} positions ({self.full_length} at full length at once)"
        )
        if self.free is None:
            return f"{kv} ({self.why})"
        return (
            f"{kv}: {self.why} ({FLAG} {self.fraction:g} of {size_text(self.free)} free after "
            f"the weights)"
        )


def size_text(n: float) -> str:
    """Bytes in GiB, MiB or KiB, whichever keeps a digit before the point."""
    for shift, unit in ((30, "GiB"), (20, "MiB")):
        if n >= 2**shift:
            return f"{n / 2**shift:,.1f} {unit}"
    return f"{n / 2**10:,.1f} KiB"


def steady(n: int) -> int:
    """n rounded down to its 4 leading binary digits (at most 1/8 less): the free memory moves
    a little from one start to the next, the pool's size (and so its compiled programs, found
    again in the compilation cache) mostly does not."""
    step = 1 << max(0, n.bit_length() - 4)
    return n // step * step


def plan_kv(
    config: ModelConfig,
    tp: int,
    *,
    slots: int,
    max_len: int | None,
    free: int | None,
    fraction: float,
    devices: int = 1,
    page: int = PAGE,
    where: str = "of host memory",
) -> KVPlan:
    """The pool's pages for `slots` requests of up to `max_len` positions (else the model's
    max_seq_len): all of them at full length when that fits in `fraction` x `free` bytes,
    else what fits (`steady`), never less than one request at full length: positions cut to fit it
    (unless `max_len` was given: SizingError, as when even POSITION_STEP positions do not
    fit). The trash page counts in the bytes."""
    check_fraction(fraction)
    per = position_bytes(config, tp, devices) * page  # bytes of a page
    want = min(max_len or config.max_seq_len, config.max_seq_len)
    rows = lambda n: -(-n // page)  # noqa: E731  pages of a request of n positions
    plan = lambda n, pages, why: KVPlan(  # noqa: E731
        slots, n, pages, page, pages * per, free, fraction, where, why
    )
    every = slots * rows(want) + 1
    if free is None:
        return plan(want, every, f"free memory unknown: not sized, {FLAG} unused")
    budget = int(fraction * free)
    if budget // per >= every:
        return plan(want, every, "every slot fits at full length")
    n = steady(budget // per)
    asked = f"{slots} slots x {want:,} positions need {size_text(every * per)} {where}"
    if n >= rows(want) + 1:
        return plan(want, int(n), f"the slots share what fits ({asked})")
    room = f"{FLAG} {fraction:g} of {size_text(free)} free is {size_text(budget)}"
    cut = (n - 1) * page // POSITION_STEP * POSITION_STEP
    if max_len is None and cut >= POSITION_STEP:
        return plan(cut, int(n), f"positions cut to fit ({asked}; give --max-len to choose)")
    least = max_len or POSITION_STEP
    fixes = ["lower --max-len"] if max_len else []
    fixes += [f"raise {FLAG}", "use a smaller model or more devices"]
    raise SizingError(
        f"no room for a KV cache of one request of {least:,} positions "
        f"({size_text((rows(least) + 1) * per)} {where}): {room}; {', '.join(fixes)}"
    )
