"""Mesh, weight partition specs, the shard_map boundary, the collectives and compile options.

    mesh = make_mesh(tp=4, data=2)              # axes data x tp, both AxisType.Auto
    forward = jit(fn, mesh=mesh)                # jax.jit with the package's XLA options

Megatron-style tensor parallelism spelled out by hand: column-parallel inputs (N, K, F split
over `tp`), one row-parallel output per module whose partial sum `reduce_tp` all-reduces;
`tie` keeps an all-reduce in flight across the next module's matmuls. `WeightSpecs` is the
single source of truth for where each weight lives (tp specs; FSDP adds `data` to the stored
ones) and `CACHE_BKSH` for the KV cache. `check_vma=True` everywhere: jax sums replicated
weights' gradients. The table, the cache layout, why the compile options are needed and the
jax internals used here (pinned jax): docs/architecture.md. This is the public namespace
`lj.sharding`; the names live by job in `layout` (mesh, weight and cache layout), `collectives`
(inside shard_map) and `compilation` (XLA options, jit), which the package imports directly.
"""

from ladder_jax.model.collectives import (  # noqa: F401
    axis_index_tp,
    embed_lookup,
    global_norm,
    local_kv_head,
    local_vocab_rows,
    read_weight,
    reduce_tp,
    shard,
    sum_of_one,
    tie,
    varies_over,
    vary_tp,
)
from ladder_jax.model.compilation import (  # noqa: F401
    CPU_KEEP_BARRIERS_PASS,
    CPU_TRAIN_OPTIONS,
    GPU_KEEP_DOTS_PASS,
    compiler_options,
    jit,
)
from ladder_jax.model.layout import (  # noqa: F401
    CACHE_BKSH,
    DATA,
    TP,
    ShardingError,
    WeightSpecs,
    cache_kv_heads,
    check_batch,
    check_divisible,
    data_size,
    default_tp,
    fits,
    largest_tp,
    make_mesh,
    tp_mesh,
    tp_size,
)
from ladder_jax.runtime import setup_host  # noqa: F401
