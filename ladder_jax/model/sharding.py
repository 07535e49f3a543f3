"""The public namespace `lj.sharding`: Megatron-style tensor parallelism spelled out by hand.
It re-exports `layout` (mesh, weight and cache layout), `collectives` (inside shard_map) and
`compilation` (XLA options, `jit`), which the package itself imports directly.

    mesh = make_mesh(tp=4, data=2); forward = jit(fn, mesh=mesh)"""

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
