"""The server's KV-cache sizing (`ladder_jax.inference.sizing`): what fits a share of the free
memory, against byte counts worked out by hand, and the cache the engine then allocates."""

import math

import pytest

from ladder_jax.config import ConfigError, ModelConfig
from ladder_jax.inference.cache import KVCache
from ladder_jax.inference.sizing import SizingError, plan_kv, position_bytes
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


def test_what_fits_is_kept():
    p = plan()  # 16 x 8,192 x 128 KiB = 16 GiB of a 32 GiB budget
    assert (p.slots, p.positions, p.kv_bytes) == (16, 8192, 16 * GiB)
    assert "max_seq_len fits" in p.line() and "16 slots x 8,192 positions, 16.0 GiB" in p.line()
    p = plan(max_len=1000, free=4 * GiB)  # 16 x 1,000 x 128 KiB = 2,000 MiB of 2,048 MiB
    assert (p.slots, p.positions, p.kv_bytes) == (16, 1000, 2000 * MiB)
    assert "fits" in p.why


def test_positions_are_cut_first_to_a_multiple_of_64():
    p = plan(free=5 * 10**9)  # budget 2.5e9 / (16 x 131,072) = 1,192.1 positions: 1,152
    assert (p.slots, p.positions) == (16, 1152)
    assert p.kv_bytes == 16 * 1152 * L8_POSITION <= 2.5e9
    assert "positions cut" in p.why and "--max-len" in p.why


def test_a_spare_tail_is_counted_in_every_row():
    p = plan(free=5 * 10**9, spare=256)  # 1,192.1 positions a row, 256 of them spare: 896
    assert (p.slots, p.positions, p.kv_bytes) == (16, 896, 16 * (896 + 256) * L8_POSITION)
    p = plan(free=200 * MiB, spare=256)  # a slot of 64 + 256 positions is 40 MiB: 2 of them
    assert (p.slots, p.positions, p.kv_bytes) == (2, 64, 80 * MiB)
    assert plan(spare=256).kv_bytes == 16 * (8192 + 256) * L8_POSITION  # 16.5 GiB: fits


def test_then_slots_when_64_positions_do_not_fit():
    p = plan(free=200 * MiB)  # budget 100 MiB; 16 x 64 positions need 128 MiB; a slot 8 MiB
    assert (p.slots, p.positions) == (12, 64)
    assert "slots cut" in p.why and "--slots" in p.why
    p = plan(max_len=4096, free=2 * GiB)  # a given --max-len is kept: 1 GiB / 512 MiB = 2 slots
    assert (p.slots, p.positions, p.kv_bytes) == (2, 4096, GiB)


def test_too_little_memory_is_one_line_naming_the_flags():
    with pytest.raises(SizingError, match=r"1 slot\(s\) x 64 positions \(8.0 MiB") as e:
        plan(free=10 * MiB)  # budget 5 MiB < one row of 64 positions
    assert "--memory-fraction 0.5 of 10.0 MiB free is 5.0 MiB" in str(e.value)
    assert "raise --memory-fraction" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SizingError, match="16 slot.s. x 64 positions.*lower --slots"):
        plan(free=200 * MiB, slots_given=True)  # the user's --slots: not cut
    with pytest.raises(SizingError, match="4 slot.s. x 4,096 positions.*lower --max-len"):
        plan(slots=4, max_len=4096, free=2 * GiB, slots_given=True)  # 2 GiB > 1 GiB budget
    assert isinstance(SizingError("x"), ConfigError)  # the commands' one line, exit 2


def test_unknown_memory_and_bad_fractions():
    p = plan(free=None)
    assert (p.slots, p.positions) == (16, 8192) and "unknown" in p.line()
    for bad in (0, -0.5, 1.5, math.nan):
        with pytest.raises(ConfigError, match="--memory-fraction"):
            plan(fraction=bad)


def test_the_planned_bytes_are_the_caches():
    """On 2 CPU devices the host holds both halves: the plan's bytes equal jax's per-device
    shard sizes of the cache the engine builds, summed over the devices."""
    model = tiny_model(2)
    c = model.config
    p = plan_kv(c, 2, slots=3, max_len=None, free=10**12, fraction=0.5, devices=2)
    cache = KVCache.abstract(c, model.mesh, p.slots, p.positions)
    shards = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize * 2
        for x in (*cache.k, *cache.v)
    )
    assert p.kv_bytes == shards
