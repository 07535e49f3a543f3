"""The paged decode-attention kernel (`ladder_jax.model.paged_kernel`, interpreted) against a
dense float64 reference: each row's pages gathered into a contiguous cache in numpy, then
`tests.reference.cache_attention` over it.

Every slot no query may see holds NaN, keys and values: the trash page 0 (the table's entries
past a row's length), the pages no row owns, and in each page the offsets past the last
position any row reads there. A score masked after the product, or a value multiplied by a
zero weight, would turn the outputs NaN, so these checks fail unless the kernel keeps such
slots out of both products. Which pages each program reads (its row's filled pages only, in
disjoint shares per split) is checked on `_pages_read`, the range the kernel loops over.
Tolerance: float32 1e-5 absolute on attention outputs of unit-variance inputs; bfloat16 2e-2
(its output rounding). Then the kernel where the model runs it (`paged.attend`, the layers'
decode and verify steps) against the XLA page loop, and compiled deviceless for an H100.
"""

import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ladder_jax.analysis import programs
from ladder_jax.inference import generation
from ladder_jax.inference.cache import PagedKV
from ladder_jax.model import paged, paged_kernel
from tests import helpers, reference

K, H, PAGE, M = 2, 16, 16, 6  # 6 pages a row: 96 positions
# each row's last position + 1 (its length): one position (at T = 4 three queries at negative
# positions), a full page, a page and one, the whole table, a row not in use (no position)
LENGTHS = np.array([1, 16, 17, M * PAGE, 0])
B = len(LENGTHS)


def _table(rng):
    """(B, M) page ids: permuted pages 1.., row 2 sharing row 3's first page (a cached
    prefix), entries past a row's filled pages the trash page 0."""
    table = np.zeros((B, M), np.int32)
    free = list(rng.permutation(np.arange(1, B * M + 1)))
    for b in (3, 0, 1, 2, 4):
        for i in range(-(-LENGTHS[b] // PAGE)):
            table[b, i] = table[3, 0] if (b, i) == (2, 0) else free.pop()
    return table


def _poisoned(pool_k, pool_v, table):
    """The pools with NaN in every slot no query may read: offsets past the last position any
    row reads in its page (all of a page no row reads, page 0 included)."""
    read = np.zeros(pool_k.shape[0], np.int64)  # offsets read, per page
    for b in range(B):
        for p in range(LENGTHS[b]):
            page = table[b, p // PAGE]
            read[page] = max(read[page], p % PAGE + 1)
    bad = np.arange(PAGE)[None, :] >= read[:, None]  # (P, page)
    return (
        np.where(bad[:, None, None, :], np.nan, pool_k).astype(pool_k.dtype),
        np.where(bad[:, None, :, None], np.nan, pool_v).astype(pool_v.dtype),
    )


def _dense(q, pool_k, pool_v, table, pos_bt):
    """The reference: each row's pages as one contiguous cache (B, K, H, S) / (B, K, S, H),
    attention of each query over slots 0..pos in float64; zeros at a negative position."""
    S = M * PAGE
    k_bkhs = pool_k[table].transpose(0, 2, 3, 1, 4).reshape(B, K, H, S)
    v_bksh = pool_v[table].transpose(0, 2, 1, 3, 4).reshape(B, K, S, H)
    out = reference.cache_attention(q, k_bkhs, v_bksh, np.maximum(pos_bt, 0))
    return np.where((pos_bt >= 0)[:, :, None, None], out, 0.0)


def _case(T, G, dtype, seed=0, poison=True):
    rng = np.random.default_rng(seed)
    P = B * M + 1
    q = rng.standard_normal((B, T, K * G, H))
    pool_k = rng.standard_normal((P, K, H, PAGE))
    pool_v = rng.standard_normal((P, K, PAGE, H))
    q, pool_k, pool_v = (jnp.asarray(x, dtype) for x in (q, pool_k, pool_v))
    table = _table(rng)
    pos_bt = (LENGTHS[:, None] - T + np.arange(T)[None, :]).astype(np.int32)
    pos_bt[LENGTHS == 0] = -1
    want = _dense(*(np.asarray(x, np.float64) for x in (q, pool_k, pool_v)), table, pos_bt)
    if poison:
        pool_k, pool_v = _poisoned(np.asarray(pool_k), np.asarray(pool_v), table)
    return (q, pool_k, pool_v, table, pos_bt), want


@pytest.mark.parametrize("min_split_slots", [paged_kernel.MIN_SPLIT_SLOTS, 2 * PAGE])
@pytest.mark.parametrize("T,G", [(1, 1), (1, 4), (4, 1), (4, 4)])
def test_paged_attention_equals_the_dense_reference(T, G, min_split_slots, monkeypatch):
    """Decode (T = 1) and verify (T = 4) steps, one query head a kv head and four (grouped
    query), over permuted pages with a shared one, in one split or three (two pages each,
    combined by their log-sum-exps: rows shorter than a split see nothing in it)."""
    monkeypatch.setattr(paged_kernel, "MIN_SPLIT_SLOTS", min_split_slots)
    splits = paged_kernel._splits(M, PAGE, B * K)[0]
    assert splits == (3 if min_split_slots == 2 * PAGE else 1)
    args, want = _case(T, G, jnp.float32)
    got = jax.jit(lambda *a: paged_kernel.attend_paged(*a, interpret=True))(*args)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("min_split_slots", [paged_kernel.MIN_SPLIT_SLOTS, 2 * PAGE])
def test_paged_attention_in_bfloat16(min_split_slots, monkeypatch):
    """bfloat16 queries and pools (a verify step, grouped queries): the output in bfloat16,
    within its rounding of the float64 reference of the same bfloat16 inputs."""
    monkeypatch.setattr(paged_kernel, "MIN_SPLIT_SLOTS", min_split_slots)
    args, want = _case(4, 4, jnp.bfloat16, seed=1)
    got = jax.jit(lambda *a: paged_kernel.attend_paged(*a, interpret=True))(*args)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-2, rtol=0)


@pytest.mark.parametrize("per_split", [M, 2, 4])
def test_each_row_reads_its_filled_pages_once(per_split):
    """The splits of a row (of one split of all pages, or of 2 or 4 pages each) read the table
    entries of the pages holding its positions 0..top, each once, and none past them (not
    the trash page its later entries point to); a row not in use (top < 0) reads none."""
    splits = -(-M // per_split)
    for top in [-7, -1, 0, 14, 15, 16, 17, 47, 48, M * PAGE - 1]:
        read = []
        for split in range(splits):
            first, last = paged_kernel._pages_read(
                jnp.int32(split), jnp.int32(top), PAGE, M, per_split
            )
            read += range(int(first), int(last))
        assert read == list(range(max(0, -(-(top + 1) // PAGE)))), (top, read)


def test_fits_takes_what_triton_can_block():
    """Powers of two for the head width and the page (16 or more), a kv head's queries
    within `MAX_KERNEL_ROWS`; what does not fit is refused with the shapes."""
    pool = jnp.zeros((3, 2, 16, 16))

    def q(T, N, H=16):
        return jnp.zeros((1, T, N, H))

    assert paged_kernel.fits(q(1, 2), pool) and paged_kernel.fits(q(4, 2 * 16), pool)
    assert not paged_kernel.fits(q(4, 2 * 17), pool)  # 68 rows a kv head
    assert not paged_kernel.fits(q(1, 2, 24), jnp.zeros((3, 2, 24, 16)))
    assert not paged_kernel.fits(q(1, 2), jnp.zeros((3, 2, 16, 8)))  # pages of 8
    with pytest.raises(ValueError, match="does not take"):
        paged_kernel.attend_paged(
            q(1, 2, 24), pool, pool, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32)
        )


@pytest.mark.parametrize("T", [1, 4, 16])
def test_the_paged_kernel_compiles_for_h100_at_llama_shapes(T):
    """Under a tp-2 shard_map (its type check on): 16 rows, 8 kv heads a device of 4 query
    heads each, head_dim 128, tables of 512 pages (8,192 positions) over a bfloat16 pool of
    8,193 pages; T = 1, 4 and 16 tokens a row (at 16, 64 query rows a program: the most
    `fits` takes, within an H100's shared memory). One Triton call per device program reading
    both pools' shards as they lie (parameters of the program, no copy), writing two splits'
    partials that XLA combines."""
    mesh = programs.gpu_mesh("h100", 2)
    Bd, Kd, Gd, Hd, Md = 16, 16, 4, 128, 512
    P = Bd * Md + 1
    specs = (
        PartitionSpec(None, None, "tp", None),
        PartitionSpec(None, "tp"),
        PartitionSpec(None, "tp"),
        PartitionSpec(),
        PartitionSpec(),
    )
    shapes = ((Bd, T, Kd * Gd, Hd), (P, Kd, Hd, PAGE), (P, Kd, PAGE, Hd), (Bd, Md), (Bd, T))
    dtypes = (jnp.bfloat16,) * 3 + (jnp.int32,) * 2
    args = [
        jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
        for shape, dtype, spec in zip(shapes, dtypes, specs)
    ]
    attend = jax.shard_map(paged_kernel.attend_paged, mesh=mesh, in_specs=specs, out_specs=specs[0])
    hlo = jax.jit(attend).lower(*args).compile().as_text()
    calls = [
        line
        for line in hlo.splitlines()
        if "custom-call(" in line and "xla.gpu.triton" in line and paged_kernel.KERNEL_NAME in line
    ]
    assert len(calls) == 1
    operands = re.search(r"custom-call\(([^)]*)\)", calls[0]).group(1).split(", ")
    for name, dims in zip(operands[-2:], ("8193,8,128,16", "8193,8,16,128")):
        (defined,) = [line for line in hlo.splitlines() if line.strip().startswith(name + " =")]
        assert f"bf16[{dims}]" in defined and " parameter(" in defined, defined
    assert paged_kernel._splits(Md, PAGE, Bd * Kd // 2)[0] == 2
    assert f"f32[16,8,2,{4 * T},128]" in calls[0]  # the splits' partials


def test_the_model_attends_over_pages_through_the_kernel_where_it_fits(monkeypatch):
    """`paged.attend` (what the model's layers call over a paged cache) with the "pallas"
    kernel runs `attend_paged` for a verify step (interpreted here) and equals its XLA form
    (`kernel="matmul"`, a second implementation) at every query with a position; a prompt
    chunk of 17 tokens (68 rows a kv head, past `MAX_KERNEL_ROWS`) takes the XLA form."""
    monkeypatch.setattr(
        paged_kernel, "attend_paged", functools.partial(paged_kernel.attend_paged, interpret=True)
    )
    args, _ = _case(4, 4, jnp.float32, seed=2, poison=False)

    def attend(kernel):
        return jax.jit(lambda *a: paged.attend(*a, kernel=kernel))

    assert "pallas_call" in str(jax.make_jaxpr(attend("pallas"))(*args))
    got, want = (np.asarray(attend(kernel)(*args)) for kernel in ("pallas", "matmul"))
    real = np.broadcast_to((args[-1] >= 0)[:, :, None, None], want.shape)
    np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=0)
    q, *pools, table, _ = args
    chunk = (jnp.tile(q, (1, 5, 1, 1))[:, :17], *pools, table, np.zeros((B, 17), np.int32))
    assert "pallas_call" not in str(jax.make_jaxpr(attend("pallas"))(*chunk))


@pytest.mark.parametrize("phase", ["decode", "verify"])
def test_the_h100_server_steps_over_pages_hold_the_kernel_per_layer(phase):
    """The deviceless H100 decode step and verify step (5 tokens a row) of the tiny model at
    tp 2 over a paged cache attend through one `paged_decode_attention` call per layer."""
    config, batch = helpers.TINY, 8
    mesh = programs.gpu_mesh("h100", 2)
    decoder = generation.Decoder(nnx.merge(*programs.abstract(config, mesh)))
    cache = PagedKV.abstract(config, mesh, batch, 256, pages=129)

    def rows_of(dtype, *shape):
        spec = PartitionSpec("data", *(None,) * len(shape))
        return jax.ShapeDtypeStruct((batch, *shape), dtype, sharding=NamedSharding(mesh, spec))

    rows = rows_of(jnp.int32)
    settings = generation.RowSampling(
        rows_of(jnp.uint32, 2), rows_of(jnp.float32), rows_of(jnp.int32), rows_of(jnp.float32)
    )
    if phase == "decode":
        lowered = decoder.lower_decode(cache, rows, rows, settings, rows)
    else:
        lowered = decoder.lower_verify(cache, rows_of(jnp.int32, 5), rows, settings, rows)
    hlo, _ = programs.compile_lowered(lowered, what=phase)
    calls = [
        line
        for line in hlo.splitlines()
        if "custom-call(" in line and "xla.gpu.triton" in line and paged_kernel.KERNEL_NAME in line
    ]
    assert len(calls) == config.n_layers


def test_the_gpu_benchmark_dry_run_checks_the_kernel_on_the_cpu(tmp_path):
    """benchmarks/paged_attention.py --dry-run (the kernels interpreted on CPU, small sizes)
    writes every case with the paged kernel checked against the row cache's kernel and the
    XLA loop, exit 0: the script a lent GPU runs works before any GPU is lent."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "pa.json"
    r = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "paged_attention.py"), "--dry-run"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0, (r.stdout, r.stderr[-2000:])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(row["ok"] for row in rows), rows
    assert all(row["rel_err_vs_xla"] < 1e-2 for row in rows), rows


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_models_steps_over_pages_on_the_kernel_equal_the_xla_loop(tp, T, monkeypatch):
    """The tiny model (head_dim 16: the kernel's dot form) at tp 1 and 2, a decode step (T 1)
    and a verify-sized step (T 3) over a paged cache of random entries on scattered pages,
    rows at positions 0, 15, 16 and one idle row (-(p + 1): it writes, attends to nothing):
    its layers' attention on the paged kernel (interpreted) == on the XLA page loop, logits
    and both pools of every layer."""
    model = helpers.tiny_model(tp, head_dim=16, n_layers=2)
    cfg, Bm, Sm = model.config, 4, 64
    pages = Bm * (Sm // PAGE) + 3
    cache = PagedKV.init(cfg, model.mesh, Bm, Sm, pages)
    table = np.random.default_rng(3).permutation(np.arange(1, pages))[: cache.table.size]
    table = jax.device_put(table.reshape(cache.table.shape).astype(np.int32), cache.table.sharding)
    layers = [
        tuple(
            jax.device_put(jax.random.normal(jax.random.key(10 * i + j), x.shape), x.sharding)
            for j, x in enumerate(kv[:2])
        )
        + (table,)
        for i, kv in enumerate(cache.layers())
    ]
    start_b = np.array([0, 15, 16, -(20 + 1)])
    step_t = np.arange(T)
    pos_bt = np.where(start_b[:, None] < 0, start_b[:, None] - step_t, start_b[:, None] + step_t)
    pos_bt = jnp.asarray(pos_bt, jnp.int32)
    tokens = jnp.asarray(np.arange(Bm * T).reshape(Bm, T) % cfg.vocab_size, jnp.int32)
    step = nnx.jit(lambda m, c: m.forward_cached(tokens, pos_bt, c))
    want_logits, want_cache = step(model, layers)
    assert all(layer.attn.kernel != "pallas" for layer in model.layers)  # CPU: the XLA loop
    calls, attend = [], paged_kernel.attend_paged

    def interpreted(*a):
        calls.append(a[0].shape)
        return attend(*a, interpret=True)

    monkeypatch.setattr(paged_kernel, "attend_paged", interpreted)
    # Pallas's interpreter cannot run under shard_map's type check (the compiled H100
    # programs above hold the kernel with the check on)
    shard_map = jax.shard_map
    monkeypatch.setattr(
        jax, "shard_map", lambda *a, **kw: shard_map(*a, **kw | {"check_vma": False})
    )
    for layer in model.layers:
        layer.attn.kernel = "pallas"
    got_logits, got_cache = nnx.jit(lambda m, c: m.forward_cached(tokens, pos_bt, c))(model, layers)
    assert calls == [(Bm, T, cfg.n_heads // tp, 16)] * cfg.n_layers
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-4)
    for got, want in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
