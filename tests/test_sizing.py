"""The server's KV-cache sizing (`ladder_jax.inference.sizing`): the pages that fit a share of the
free memory, against byte counts worked out by hand, and the cache the engine then allocates."""

import math

import pytest

from ladder_jax.config import ConfigError, ModelConfig
from ladder_jax.inference.cache import PagedKV
from ladder_jax.inference.sizing import SizingError, plan_kv, position_bytes, steady
from tests.helpers import tiny_model

MiB, GiB = 2**20, 2**30
L8 = ModelConfig.from_preset("llama-3-8b")  # 32 layers, 8 kv heads of 128, bf16, 8,192 positions
L8_POSITION = 2 * 32 * 8 * 128 * 2  # k and v, every layer: 131,072 bytes


def plan(**kw):
    args = dict(slots=16, max_len=None, free=64 * GiB, fraction=0.5)
    return plan_kv(L8, 1, **{**args, **kw})


def test_position_bytes_by_hand():
    assert position_bytes(L8, 1) == L8_POSITION
    assert position_bytes(L8, 2) == L8_POSITION // 2  # 4 of the 8 kv heads on each device
    assert position_bytes(L8, 2, devices=2) == L8_POSITION  # both halves in one host's memory
    assert position_bytes(L8, 16) == L8_POSITION // 8  # 16 > 8 kv heads: one copy per device
    smollm2 = ModelConfig.from_preset("tiny", n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64)
    assert position_bytes(smollm2, 1) == 2 * 30 * 3 * 64 * 4  # float32: 46,080 bytes


PAGE = 16 * L8_POSITION  # 2 MiB
M = 8192 // 16  # pages of a request at the model's length


def test_what_fits_is_kept():
    p = plan()  # 16 x 512 pages + the trash page of 2 MiB = 16 GiB + 2 MiB of a 32 GiB budget
    assert (p.slots, p.positions, p.pages, p.kv_bytes) == (16, 8192, 16 * M + 1, 16 * GiB + PAGE)
    assert p.full_length == 16 and "every slot fits at full length" in p.why
    assert p.line().startswith(
        "KV cache: 8,192 pages of 16 positions, 16.0 GiB of host memory, for 16 slots of up to "
        "8,192 positions (16 at full length at once): every slot fits"
    )
    p = plan(max_len=1000, free=4 * GiB)  # 16 x 63 pages + 1 = 1,009 x 2 MiB of 2,048 MiB
    assert (p.slots, p.positions, p.pages, p.kv_bytes) == (16, 1000, 16 * 63 + 1, 1009 * PAGE)


def test_the_slots_share_the_pages_that_fit():
    p = plan(free=5 * 10**9)  # budget 2.5e9 / 2 MiB = 1,192 pages, steady: 1,152 (9 x 128)
    assert (p.slots, p.positions, p.pages, p.full_length) == (16, 8192, 1152, 2)
    assert p.kv_bytes == 1152 * PAGE <= 2.5e9
    assert "share what fits" in p.why
    # a restart with a little less memory free keeps the pool (and its compiled programs)
    assert plan(free=int(5 * 10**9 * 0.97)).pages == 1152


def test_steady_keeps_four_binary_digits():
    assert [steady(n) for n in (0, 1, 15, 16, 17, 33, 1192, 1293, 2057)] == [
        0, 1, 15, 16, 16, 32, 1152, 1280, 2048,
    ]  # fmt: skip
    assert all(n * 7 / 8 <= steady(n) <= n for n in range(1, 5000))


def test_positions_are_cut_when_one_request_does_not_fit():
    p = plan(free=2 * GiB)  # 512 pages, one short of a request of 8,192 and the trash page
    assert (p.positions, p.pages) == (8128, 512)  # 511 x 16 = 8,176 cut to a multiple of 64
    assert "positions cut" in p.why and "--max-len" in p.why
    p = plan(free=200 * MiB)  # 50 pages, steady: 48; 47 x 16 = 752 positions, cut to 704
    assert (p.slots, p.positions, p.pages, p.kv_bytes) == (16, 704, 48, 96 * MiB)


def test_too_little_memory_is_one_line_naming_the_flags():
    with pytest.raises(SizingError, match=r"one request of 64 positions \(10.0 MiB") as e:
        plan(free=10 * MiB)  # budget 5 MiB: 2 pages, not the 4 + 1 of 64 positions
    assert "--memory-fraction 0.5 of 10.0 MiB free is 5.0 MiB" in str(e.value)
    assert "raise --memory-fraction" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SizingError, match="one request of 4,096 positions.*lower --max-len"):
        plan(max_len=4096, free=GiB)  # 256 pages < 256 + 1
    assert isinstance(SizingError("x"), ConfigError)  # the commands' one line, exit 2


def test_unknown_memory_and_bad_fractions():
    p = plan(free=None)
    assert (p.slots, p.positions, p.pages) == (16, 8192, 16 * M + 1) and "unknown" in p.line()
    for bad in (0, -0.5, 1.5, math.nan):
        with pytest.raises(ConfigError, match="--memory-fraction"):
            plan(fraction=bad)


def test_the_planned_bytes_are_the_caches():
    """On 2 CPU devices the host holds both halves: the plan's bytes equal jax's per-device
    shard sizes of the paged cache the engine builds, summed over the devices."""
    model = tiny_model(2)
    c = model.config
    p = plan_kv(c, 2, slots=3, max_len=None, free=10**12, fraction=0.5, devices=2)
    cache = PagedKV.abstract(c, model.mesh, p.slots, p.positions, p.pages)
    shards = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize * 2
        for x in (*cache.k, *cache.v)
    )
    assert p.kv_bytes == shards
