"""Mesh, weight partition specs, the shard_map boundary, and the overlap-preserving reduce.

Tensor parallelism here is Megatron-style and spelled out by hand: every module (attention,
MLP) starts with column-parallel matmuls (heads N / kv heads K / MLP hidden F split over the
`tp` mesh axis) and ends with one row-parallel matmul whose result is a *partial sum* on each
rank. `reduce_tp` is the only place a module output is all-reduced; `tie` is how the ladder
keeps an all-reduce in flight across the next module's matmuls. Nothing is hidden in hooks.

Making the ladder's overlap real (measured on the compiled GPU schedule, see
`ladder_jax.overlap`): writing the psum of module i before module i+1 is not enough. XLA's
all-reduce combiner merges the two now-independent psums into one synchronous all-reduce, and
fusion pulls `x + psum_i` forward. Two things fix it, and both are applied by the package:
1. the model ties (`tie`) the in-flight result to the next module's output before adding it to
   the stream, so its only consumer comes after that module's matmuls (and the ladder's
   hand-written backward does the same with cotangents, see `ladder_jax.model.residual`);
2. `compiler_options("gpu")`, applied wherever the package compiles (`jit`), turns the
   combiner off. If you jit the model yourself on GPUs, use `ladder_jax.model.sharding.jit`.
On CPU, `compiler_options("cpu")` keeps those ties through XLA:CPU's fusion, without which the
ladder's backward costs quadratically in depth (see `CPU_KEEP_BARRIERS_PASS`); training and
decoding compile with it, through `jit`.

Mesh axes: `data` (batch) x `tp` (tensor parallel). Both are `AxisType.Auto`, so arrays need
not carry shardings before they enter the model; jit moves them.

How each weight is laid out (the `WeightSpecs` table below is the single source of truth):

| weight (einsum shape)    | spec              | why |
|--------------------------|-------------------|-----|
| q (D, N, H)              | (-, tp, -)        | column parallel over query heads |
| k, v (D, K, H)           | (-, tp, -)        | column parallel over kv heads ... |
|                          | (-, -, -) if K<tp | ... or replicated when fewer kv heads than ranks |
| o (N, H, D)              | (tp, -, -)        | row parallel: partial sums, one psum |
| gate, up (D, F)          | (-, tp)           | column parallel over the MLP hidden |
| down (F, D)              | (tp, -)           | row parallel |
| norm scales (D,)         | (-)               | tiny, replicated |
| embed (V, D)             | (-, -)            | replicated: the lookup needs no collective |
| head (D, V)              | (-, tp)           | vocab-parallel logits, returned sharded over V |
| cache keys (B, K', H, S) | (data, tp, -, -)  | K' = max(K, tp): see `CACHE_BKSH` |
| cache values (B,K',S,H)  | (data, tp, -, -)  | (keys keep their slots last) |
| fused input (D, C)       | (-, tp)           | decoding only (`linear.FusedLinear`): each |
|                          |                   | rank's columns of q, k, v (+ gate, up) or gate, up|

Memory costs of the replicated pieces, per rank:
- embed: V*D values (llama-3-70b: 128256*8192*2 B = 2.1 GB in bf16). The lookup then costs no
  communication and the first all-reduce of the network is a module's, which keeps the ladder's
  overlap pattern intact. With tied embeddings the head reads a V/tp slice of this same table.
- kv heads when K < tp: every rank holds all K heads of k and v (2*D*K*H values per layer,
  llama-3-70b at tp=16: 32 MB/layer in bf16) and uses the one its query heads belong to. Each
  kv head is computed by tp/K ranks; its gradient is summed over them by shard_map.

FSDP (`mesh.fsdp=true`, `Transformer(..., fsdp=True)`): every weight is also *stored* split over
`data` (`WeightSpecs.fsdp`), with its AdamW moments, and enters the shard_map that way; a module
all-gathers its weights over `data` where it reads them (`read_weight`), so a rank holds whole
only the weights of the modules at work, and each gradient leaves the backward reduce-scattered
over `data`. Without FSDP, weights are replicated over `data` and their gradients all-reduced.

Gradients of replicated weights are summed over `tp` by shard_map itself: we keep
`check_vma=True` everywhere so that this bookkeeping is done by JAX, not by hand.
"""

# The names live by job in `layout` (mesh, weight and cache layout), `collectives` (inside
# shard_map) and `compilation` (XLA options, jit); this module keeps every public name.
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
    make_mesh,
    tp_size,
)
from ladder_jax.runtime import setup_host  # noqa: F401
