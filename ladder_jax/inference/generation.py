"""KV-cached generation: the jitted prefill and one-token step (`Decoder`), batched `generate`
and the decode benchmark (`python -m ladder_jax.decode`). What it guarantees and checks:
docs/inference.md, 'Decode' and 'From Python'.

    texts = generate(model, ["Once upon a time"], max_new_tokens=64, temperature=0.8, seed=0)"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ladder_jax import hardware, runtime
from ladder_jax.config import ModelConfig
from ladder_jax.inference.cache import KVCache, PagedKV, cache_length, round_up
from ladder_jax.inference.sampling import (
    NONFINITE,
    GenerationError,
    NonFiniteLogits,
    RowSampling,
    Sampling,
    is_int,
    sample,
    sample_rows,
)
from ladder_jax.interop.tokenizer import ByteTokenizer
from ladder_jax.model import quant, sharding
from ladder_jax.model.layout import DATA
from ladder_jax.model.transformer import Transformer, fuse_inputs

__all__ = [
    "GenerationError",
    "KVCache",
    "RowSampling",
    "Sampling",
    "sample",
    "cache_length",
    "Decoder",
    "TOP_LOGPROBS",
    "generate",
    "check_generation",
    "benchmark",
    "to_device",
    "to_host",
]


# ---------------------------------------------------------------------------------------------
# The jitted programs.


def _cache_type(paged: bool):
    return PagedKV if paged else KVCache


@functools.lru_cache(maxsize=16)
def _programs(graphdef, treedef, mesh, paged: bool = False):
    """The jitted (prefill, decode_step, prefill_slots, decode_steps) of a model graph whose
    weights come as the flat list `treedef` describes, on `mesh`, over a `KVCache` (or with
    `paged`, a `PagedKV`). Cached: every Decoder of an equal graph (the same config, scheme
    and mesh: each `generate` call makes one) shares the same jitted functions, so their
    compiled programs are reused, not compiled again."""
    replicated = NamedSharding(mesh, P())
    Cache = _cache_type(paged)

    def merged(weights):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))

    def prefill(weights, cache, tokens_bt, lengths_b, rows):
        model = merged(weights)
        # positions None: the prompt from slot 0, flash attention over the prompt itself
        logits_btv, layers = model.forward_cached(tokens_bt, None, cache.layers())
        last_bv = jnp.take_along_axis(logits_btv, (lengths_b - 1)[:, None, None], axis=1)
        first_b = jnp.zeros(tokens_bt.shape[:1], jnp.int32)
        return sample_rows(last_bv[:, 0], rows, first_b), Cache.from_layers(layers)

    def decode_step(weights, cache, tokens_b, positions_b, rows, token_b):
        model = merged(weights)
        logits_btv, layers = model.forward_cached(
            tokens_b[:, None], positions_b[:, None], cache.layers()
        )
        return sample_rows(logits_btv[:, 0], rows, token_b), Cache.from_layers(layers)

    def decode_steps(weights, cache, tokens_b, positions_b, rows, token_b, steps):
        def one(carry, _):
            cache, tokens_b, positions_b, token_b = carry
            nxt_b, cache = decode_step(weights, cache, tokens_b, positions_b, rows, token_b)
            # past the cache's end (a finished row running on): its last slot, discarded
            positions_b = _advance(positions_b, cache.length)
            return (cache, nxt_b, positions_b, token_b + 1), nxt_b

        (cache, *_), tokens_kb = jax.lax.scan(
            one, (cache, tokens_b, positions_b, token_b), None, length=steps
        )
        return tokens_kb, cache

    def prefill_slots(weights, cache, slots_n, tokens_nt, lengths_n, rows_n):
        # slots past the cache's end are padding: their row is computed and dropped
        first_n, picked = prefill(weights, cache.pick(slots_n), tokens_nt, lengths_n, rows_n)
        return first_n, cache.put(slots_n, picked)

    out = (replicated, Cache.shardings(mesh))
    jit = functools.partial(sharding.jit, mesh=mesh, donate_argnums=(1,), out_shardings=out)
    return (
        jit(prefill),
        jit(decode_step),
        jit(prefill_slots),
        jit(decode_steps, static_argnums=(6,)),
    )


def _advance(positions_b, length: int):
    """The next decode step's positions: one on, a finished row running on staying at the
    cache's last slot (its tokens are discarded), an idle row (negative: `attend_rotated`'s
    convention) where it is."""
    return jnp.where(positions_b < 0, positions_b, jnp.minimum(positions_b + 1, length - 1))


COPY_BLOCK = 128  # cache slots copy_prefix moves per loop step

TOP_LOGPROBS = 20  # the most alternatives per token the scored programs return


@functools.lru_cache(maxsize=16)
def _scored_programs(graphdef, treedef, mesh, top: int, paged: bool = False):
    """The jitted (prefill_slots, decode_steps) of `_programs` that also score: each returns
    the log-probabilities (log-softmax of the raw logits, before temperature or any cut) of
    the tokens it reads or draws and the `top` most likely tokens with theirs. Compiled on
    first use, apart from the plain programs, which they leave as they are."""
    replicated = NamedSharding(mesh, P())
    Cache = _cache_type(paged)

    def merged(weights):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))

    def scores(logits_xv, chosen_x):
        """(log p of chosen_x, top ids, their log p) from logits (..., V)."""
        logits_xv = logits_xv.astype(jnp.float32)
        lse_x = jax.nn.logsumexp(logits_xv, axis=-1)
        chosen = jnp.take_along_axis(logits_xv, chosen_x[..., None], axis=-1)[..., 0] - lse_x
        top_lp, top_id = jax.lax.top_k(logits_xv, top)
        return chosen, top_id.astype(jnp.int32), top_lp - lse_x[..., None]

    def prefill_slots(weights, cache, slots_n, tokens_nt, lengths_n, rows_n):
        # as _programs' prefill_slots; position t is scored against the token at t + 1 (the
        # prompt's next token, the drawn first token at the prompt's last position)
        picked = cache.pick(slots_n)
        logits_ntv, layers = merged(weights).forward_cached(tokens_nt, None, picked.layers())
        last_nv = jnp.take_along_axis(logits_ntv, (lengths_n - 1)[:, None, None], axis=1)[:, 0]
        first_n = sample_rows(last_nv, rows_n, jnp.zeros(tokens_nt.shape[:1], jnp.int32))
        T = tokens_nt.shape[1]
        next_nt = jnp.concatenate([tokens_nt[:, 1:], tokens_nt[:, :1]], axis=1)
        next_nt = jnp.where(
            jnp.arange(T)[None] == (lengths_n - 1)[:, None], first_n[:, None], next_nt
        )
        scored = scores(logits_ntv, next_nt)
        return (first_n, *scored), cache.put(slots_n, Cache.from_layers(layers))

    def decode_steps(weights, cache, tokens_b, positions_b, rows, token_b, steps):
        def one(carry, _):
            cache, tokens_b, positions_b, token_b = carry
            logits_btv, layers = merged(weights).forward_cached(
                tokens_b[:, None], positions_b[:, None], cache.layers()
            )
            nxt_b = sample_rows(logits_btv[:, 0], rows, token_b)
            cache = Cache.from_layers(layers)
            positions_b = _advance(positions_b, cache.length)
            return (cache, nxt_b, positions_b, token_b + 1), (
                nxt_b,
                *scores(logits_btv[:, 0], nxt_b),
            )

        (cache, *_), out = jax.lax.scan(
            one, (cache, tokens_b, positions_b, token_b), None, length=steps
        )
        return out, cache

    out = (replicated, Cache.shardings(mesh))
    jit = functools.partial(sharding.jit, mesh=mesh, donate_argnums=(1,), out_shardings=out)
    return jit(prefill_slots), jit(decode_steps, static_argnums=(6,))


@functools.lru_cache(maxsize=16)
def _serving_programs(graphdef, treedef, mesh, paged: bool = False):
    """The server's jitted (extend_slots, verify, copy_prefix) (`Decoder`'s methods of those
    names): a chunk of several rows' prompts at each row's own offset, the K tokens of a
    speculative step, and a copy of rows' leading cache positions. Compiled on first use."""
    replicated = NamedSharding(mesh, P())
    Cache = _cache_type(paged)

    def merged(weights):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))

    def extend_slots(weights, cache, slots_n, tokens_nt, starts_n, lengths_n, rows_n, token_n):
        # as prefill_slots, but row n's T tokens sit at positions starts_n[n]...: its cache
        # row keeps what lies before and the chunk attends to it
        picked = cache.pick(slots_n)
        T = tokens_nt.shape[1]
        positions_nt = starts_n[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        logits_ntv, layers = merged(weights).forward_cached(
            tokens_nt, positions_nt, picked.layers()
        )
        last_nv = jnp.take_along_axis(logits_ntv, (lengths_n - 1)[:, None, None], axis=1)[:, 0]
        new = Cache.from_layers(layers)
        return sample_rows(last_nv, rows_n, token_n), cache.put(slots_n, new)

    def verify(weights, cache, tokens_bk, positions_b, rows, token_b):
        B, K = tokens_bk.shape
        # an idle row (-(p + 1)) writes its K entries from p on and attends to nothing
        step_k = jnp.arange(K, dtype=jnp.int32)[None]
        positions_bk = jnp.where(
            positions_b[:, None] < 0, positions_b[:, None] - step_k, positions_b[:, None] + step_k
        )
        logits_bkv, layers = merged(weights).forward_cached(tokens_bk, positions_bk, cache.layers())
        # position j draws token token_b + j with that token's own key, as a decode step would
        rows_x = jax.tree.map(lambda x: jnp.repeat(x, K, axis=0), rows)
        index_x = (token_b[:, None] + jnp.arange(K, dtype=jnp.int32)[None]).reshape(-1)
        sampled_x = sample_rows(logits_bkv.reshape(B * K, -1), rows_x, index_x)
        return sampled_x.reshape(B, K), Cache.from_layers(layers)

    def copy_prefix(cache, src_n, dst_n, lengths_n):
        def one(c, axis):  # slots lie on `axis` of a layer's (B, ...) array
            # block by block up to the longest copy: what it moves is the copies' length, not
            # whole rows (a row of a long cache is hundreds of MB)
            S = c.shape[axis]
            C = min(COPY_BLOCK, S)
            shape = [1] * c.ndim
            shape[0], shape[axis] = -1, C

            def block(j, c):
                start = jnp.minimum(j * C, S - C)  # the last block may overlap the one before
                blk = jax.lax.dynamic_slice_in_dim(c, start, C, axis)
                slot = start + jnp.arange(C, dtype=jnp.int32)
                keep = (slot[None] < lengths_n[:, None]).reshape(shape)
                src = jnp.take(blk, src_n, axis=0, mode="clip")
                dst = jnp.take(blk, dst_n, axis=0, mode="clip")
                blk = blk.at[dst_n].set(jnp.where(keep, src, dst), mode="drop")
                return jax.lax.dynamic_update_slice_in_dim(c, blk, start, axis)

            return jax.lax.fori_loop(0, (jnp.max(lengths_n) + C - 1) // C, block, c)

        return KVCache(tuple(one(k, 3) for k in cache.k), tuple(one(v, 2) for v in cache.v))

    out = (replicated, Cache.shardings(mesh))
    jit = functools.partial(sharding.jit, mesh=mesh, donate_argnums=(1,), out_shardings=out)
    copy = sharding.jit(copy_prefix, mesh=mesh, donate_argnums=(0,), out_shardings=out[1])
    return jit(extend_slots), jit(verify), copy


class Decoder:
    """The jitted prefill and decode step of one model (compiled once per shape).

    `prefill(cache, tokens_bt, lengths_b, rows)` -> (first new tokens (B,), cache)
    `decode_step(cache, tokens_b, positions_b, rows, token_b)` -> (next tokens (B,), cache):
        `token_b` is the index of the token each row produces (its key is fold_in(row key, n))
    `decode_steps(cache, tokens_b, positions_b, rows, token_b, steps)` -> (tokens (steps, B),
        cache): `steps` decode steps in one program (the server's multi-step scheduling)
    `prefill_slots(cache, slots_n, tokens_nt, lengths_n, rows_n)` -> (first tokens (n,),
        cache): n prompts (ragged, padded to T) into rows `slots_n` of the cache (meshes with
        data = 1); slots >= the cache's batch are padding (computed, not written)
    `prefill_slots_scored`, `decode_steps_scored`: the same, also returning log-probabilities
        (the server's logprobs and echo; compiled on first use)
    `extend_slots`, `verify`, `copy_prefix`: the server's chunked prefill, speculative step
        and prefix copy (their docstrings; compiled on first use)
    The cache argument is donated: use only the returned one. `rows` is a `RowSampling`. A
    cache is a `KVCache` (rows) or a `PagedKV` (pages: the server's; `copy_prefix` takes rows
    only); each kind has its own compiled programs.

    A quantized model (`ladder_jax.model.quant`) on a CPU mesh is decoded through its float
    copy, dequantized once here (XLA:CPU's int8 matmuls are much slower than float32); on GPU
    meshes the programs read the int8 weights.

    The input projections are fused here once (`fuse_inputs`): a copy of about 2/3 of the
    weights, held while the model is alive too; `fused` says whether it was made
    (`fusion_fits`: not where it would take over half the free memory). `consume=True`: the
    decoder owns `model` and fuses in place, freeing the separate projections layer by layer
    (always fused, no copy held; `model` must not be used again): `decode` and `serve` do.
    """

    def __init__(self, model: Transformer, *, consume: bool = False):
        self.model = model
        mesh = model.mesh
        if mesh.devices.flat[0].platform == "cpu":
            model = quant.dequantize(model)
        # q/k/v and gate/up (parallel: all five) fused once here, not concatenated by XLA on
        # every step; unless their copy would crowd the memory the model's devices have left
        self.fused = consume or fusion_fits(model)
        graphdef, self.state = nnx.split(
            fuse_inputs(model, in_place=consume) if self.fused else model
        )
        # the programs take the weights as one flat list, flattened here once: a State would be
        # flattened again, Variable by Variable in Python, on every call of every step
        self.weights, treedef = jax.tree.flatten(self.state)
        self._graphdef, self._treedef = graphdef, treedef
        self._plain_sets = {False: _programs(graphdef, treedef, mesh)}

    def prefill(self, cache, tokens_bt, lengths_b, rows):
        return self._plain(cache)[0](self.weights, cache, tokens_bt, lengths_b, rows)

    def decode_step(self, cache, tokens_b, positions_b, rows, token_b):
        return self._plain(cache)[1](self.weights, cache, tokens_b, positions_b, rows, token_b)

    def lower_prefill(self, cache, tokens_bt, lengths_b, rows):
        """The prefill program lowered for these arguments (arrays or ShapeDtypeStructs), for
        reading its HLO (`ladder_jax.analysis.programs`)."""
        return self._plain(cache)[0].lower(self.weights, cache, tokens_bt, lengths_b, rows)

    def lower_decode(self, cache, tokens_b, positions_b, rows, token_b):
        """The decode step program lowered for these arguments, as `lower_prefill`."""
        return self._plain(cache)[1].lower(
            self.weights, cache, tokens_b, positions_b, rows, token_b
        )

    def lower_decode_steps(self, cache, tokens_b, positions_b, rows, token_b, steps: int):
        """The decode_steps program lowered for these arguments, as `lower_prefill`."""
        return self._plain(cache)[3].lower(
            self.weights, cache, tokens_b, positions_b, rows, token_b, steps
        )

    def decode_steps(self, cache, tokens_b, positions_b, rows, token_b, steps: int):
        """`steps` decode steps in one program, each feeding the tokens the previous drew
        (positions and token indices + 1 per step) -> (tokens (steps, B), cache)."""
        return self._plain(cache)[3](
            self.weights, cache, tokens_b, positions_b, rows, token_b, steps
        )

    def prefill_slots(self, cache, slots_n, tokens_nt, lengths_n, rows_n):
        """n prompts into rows `slots_n` of the cache in one program (the server's admissions
        of one round); a slot >= the cache's batch is padding, computed and never written."""
        return self._plain(cache)[2](self.weights, cache, slots_n, tokens_nt, lengths_n, rows_n)

    def extend_slots(self, cache, slots_n, tokens_nt, starts_n, lengths_n, rows_n, token_n):
        """n rows' next T tokens (ragged: `lengths_n` of them real) at positions starts_n[n]...
        of cache rows `slots_n` (a slot >= the cache's batch is padding: computed, never
        written), attending to what each row holds before them -> (the token drawn at each
        row's last real position, as token `token_n` of its output (n,), cache): a prompt's
        chunk at its offset, or the rest of a prompt after a reused prefix."""
        return self._serving(cache)[0](
            self.weights, cache, slots_n, tokens_nt, starts_n, lengths_n, rows_n, token_n
        )

    def verify(self, cache, tokens_bk, positions_b, rows, token_b):
        """Every row's K tokens (its newest token, then K - 1 drafted ones) at positions
        positions_b[b]... -> (tokens (B, K), cache): the token drawn after each of them,
        position j as token token_b + j of its row's output (the key a decode step would use).
        Drafts are right up to the first j where draft j + 1 != drawn j (speculation)."""
        return self._serving(cache)[1](self.weights, cache, tokens_bk, positions_b, rows, token_b)

    def copy_prefix(self, cache, src_n, dst_n, lengths_n):
        """Cache row dst_n[n]'s positions [0, lengths_n[n]) := row src_n[n]'s, for every n (a
        dst >= the cache's batch is padding) -> cache. Rows must not be both a src and a dst."""
        return self._serving(cache)[2](cache, src_n, dst_n, lengths_n)

    def lower_extend(self, cache, slots_n, tokens_nt, starts_n, lengths_n, rows_n, token_n):
        """The extend_slots program lowered for these arguments, as `lower_prefill`."""
        return self._serving(cache)[0].lower(
            self.weights, cache, slots_n, tokens_nt, starts_n, lengths_n, rows_n, token_n
        )

    def lower_verify(self, cache, tokens_bk, positions_b, rows, token_b):
        """The verify program lowered for these arguments, as `lower_prefill`."""
        return self._serving(cache)[1].lower(
            self.weights, cache, tokens_bk, positions_b, rows, token_b
        )

    def _plain(self, cache):
        paged = isinstance(cache, PagedKV)
        if paged not in self._plain_sets:
            self._plain_sets[paged] = _programs(
                self._graphdef, self._treedef, self.model.mesh, paged
            )
        return self._plain_sets[paged]

    def _serving(self, cache):
        paged = isinstance(cache, PagedKV)
        return _serving_programs(self._graphdef, self._treedef, self.model.mesh, paged)

    def _scored(self, cache):
        top = min(TOP_LOGPROBS, self.model.config.vocab_size)
        paged = isinstance(cache, PagedKV)
        return _scored_programs(self._graphdef, self._treedef, self.model.mesh, top, paged)

    def prefill_slots_scored(self, cache, slots_n, tokens_nt, lengths_n, rows_n):
        """`prefill_slots`, scored -> ((first tokens (n,), log p (n, T), top ids (n, T, K),
        top log p (n, T, K)), cache): position t scores the prompt's token t + 1, the last
        prompt position the first token; K = min(TOP_LOGPROBS, vocab). Log-probabilities are
        the log-softmax of the raw logits (before temperature, top-k, top-p)."""
        return self._scored(cache)[0](self.weights, cache, slots_n, tokens_nt, lengths_n, rows_n)

    def decode_steps_scored(self, cache, tokens_b, positions_b, rows, token_b, steps: int):
        """`decode_steps`, scored -> ((tokens, log p (steps, B), top ids, top log p (steps, B,
        K)), cache): each drawn token's log-probability from the logits it was drawn from."""
        return self._scored(cache)[1](
            self.weights, cache, tokens_b, positions_b, rows, token_b, steps
        )


def fusion_fits(model: Transformer, share: float = 0.5) -> bool:
    """Whether the decoder may fuse `model`'s input projections (`fuse_inputs`): their fused
    copy lives beside the model's own weights while both are alive (about 2/3 of the weights
    again), so it is made only when it takes at most `share` of the memory still free on the
    model's devices (each GPU's allocator; the host's for CPU devices, which share it).
    Otherwise the decoder runs the separate matmuls (XLA may then copy the weights it merges
    on every step: slower, no more memory) and says so once. Abstract models (the deviceless
    programs) and runs of several processes (which must all compile the same program, whatever
    each one's free memory) are fused without a check."""
    if jax.process_count() > 1:
        return True
    layer = model.layers[0]
    weights = [lin.weight.get_value() for lin in layer.input_linears()]
    if any(not isinstance(w, jax.Array) for w in weights):
        return True
    device = model.mesh.devices.flat[0]
    if device.platform == "cpu":
        free = runtime.available_memory()
        need = sum(sh.data.nbytes for w in weights for sh in w.addressable_shards)
    else:
        try:
            stats = device.memory_stats() or {}
        except Exception:  # a backend that keeps no statistics: no check
            stats = {}
        free = (
            stats["bytes_limit"] - stats.get("bytes_in_use", 0) if "bytes_limit" in stats else None
        )
        need = sum(w.addressable_data(0).nbytes for w in weights)
    need *= len(model.layers)
    if free is None or need <= share * free:
        return True
    warnings.warn(
        f"decoding without fused input projections: their copy ({need / 1e9:.1f} GB per "
        f"{'host' if device.platform == 'cpu' else 'device'}) would take more than "
        f"{share:.0%} of the {free / 1e9:.1f} GB free",
        stacklevel=3,
    )
    return False


# ---------------------------------------------------------------------------------------------
# Host <-> device, valid on one process or many (every process runs the same program).


def to_device(array: np.ndarray, mesh, spec=P()) -> jax.Array:
    array = np.asarray(array)
    return jax.make_array_from_callback(
        array.shape, NamedSharding(mesh, spec), lambda index: array[index]
    )


def rows_to_device(rows: RowSampling, mesh, batch_spec=P(DATA)) -> RowSampling:
    keys_spec = P(*batch_spec, None)
    return RowSampling(
        to_device(rows.keys, mesh, keys_spec),
        to_device(rows.temperature, mesh, batch_spec),
        to_device(rows.top_k, mesh, batch_spec),
        to_device(rows.top_p, mesh, batch_spec),
    )


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated result, read from this process's first copy."""
    return np.asarray(x.addressable_data(0))


# ---------------------------------------------------------------------------------------------
# Generation.

_UNSET = object()


def generate(
    model: Transformer,
    prompts,
    *,
    max_new_tokens: int = 64,
    sampling: Sampling | None = None,
    temperature=_UNSET,
    top_k=_UNSET,
    top_p=_UNSET,
    seed=_UNSET,
    eos_id: int | None = None,
    tokenizer=None,
    stream: Callable[[int, list[int]], None] | None = None,
    decoder: Decoder = None,
):
    """Generates a continuation of every prompt (a batch, any mix of lengths).

    `prompts`: a batch, of strings (encoded with `tokenizer`, default the byte tokenizer,
    which also decodes the result) or of token ids: lists of ints, 1-D integer arrays, or one
    2-D integer array (batch, length) like Hugging Face's `input_ids` (every row is taken
    whole: there is no attention mask, so padded rows would read their padding as prompt; give
    a list of 1-D arrays instead). One prompt's ids alone (a flat list or a 1-D array) are
    refused, as transformers' `generate` needs 2-D input_ids too: pass `[ids]` or `ids[None]`.
    Floats, strings, bools or bytes among token ids are refused, never converted.

    `sampling`: a `Sampling` (default greedy); the keywords temperature / top_k / top_p / seed
    build one instead (give one form, not both). Row b draws with fold_in(key(seed), b)
    (`ladder_jax.inference.sampling`). A row stops at `eos_id` (default: the tokenizer's EOS,
    if there is a tokenizer); the others go on to `max_new_tokens`. `stream(step, tokens)` is
    called with each step's new token per row, as soon as it reaches the host. Returns the new
    tokens (EOS excluded) per row, or texts when the prompts were strings. Logits that are NaN
    or infinite raise `NonFiniteLogits` (a `GenerationError`).
    """
    c = model.config
    keywords = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    sampling = _sampling(sampling, keywords, c.vocab_size)
    texts, rows = _prompt_rows(prompts)
    if texts:
        tokenizer = tokenizer or ByteTokenizer()
        rows = [tokenizer.encode(p) for p in rows]
    if eos_id is None and tokenizer is not None:
        eos_id = tokenizer.eos_id
    check_generation(c, rows, max_new_tokens)
    decoder = decoder if decoder is not None else Decoder(model)
    mesh = model.mesh

    # Shapes are rounded so that nearby requests reuse compiled programs.
    n = len(rows)
    B = round_up(n, sharding.data_size(mesh))
    lengths = np.array([len(r) for r in rows] + [1] * (B - n), np.int32)
    T = min(round_up(int(lengths.max()), 16), c.max_seq_len)
    S = cache_length(c, int(lengths.max()), max_new_tokens)
    tokens_bt = np.zeros((B, T), np.int32)
    for b, r in enumerate(rows):
        tokens_bt[b, : len(r)] = r

    cache = KVCache.init(c, mesh, B, S)
    batch = P(DATA)
    settings = rows_to_device(RowSampling.of([sampling] * B), mesh)
    new_b, cache = decoder.prefill(
        cache, to_device(tokens_bt, mesh, P(DATA, None)), to_device(lengths, mesh, batch), settings
    )
    out = [[] for _ in range(n)]
    done = np.zeros(n, bool)
    pending = new_b  # the newest step's tokens, still on the device
    for t in range(max_new_tokens):
        # Queue step t+1 before reading step t: the device never idles, and at most two
        # programs are ever in flight.
        if t + 1 < max_new_tokens:
            positions_b = to_device(lengths + t, mesh, batch)
            token_b = to_device(np.full(B, t + 1, np.int32), mesh, batch)
            nxt, cache = decoder.decode_step(cache, pending, positions_b, settings, token_b)
        step_tokens = to_host(pending)[:n]
        _check_finite(step_tokens, done, t)
        for b in range(n):
            if not done[b]:
                if step_tokens[b] == eos_id:
                    done[b] = True
                else:
                    out[b].append(int(step_tokens[b]))
        if stream is not None:
            stream(t, [int(x) for x in step_tokens])
        if done.all() or t + 1 == max_new_tokens:
            break
        pending = nxt
    return [tokenizer.decode(o) for o in out] if texts else out


def _sampling(sampling, keywords: dict, vocab_size: int) -> Sampling:
    """`generate`'s Sampling: the one given, or one built from the keywords given (default
    greedy), checked against the vocabulary; both forms at once are refused."""
    keywords = {k: v for k, v in keywords.items() if v is not _UNSET}
    if sampling is not None and keywords:
        raise GenerationError(
            f"give sampling=Sampling(...) or the keywords {', '.join(keywords)}, not both"
        )
    if sampling is not None and not isinstance(sampling, Sampling):
        raise GenerationError(
            f"sampling={sampling!r} must be a Sampling(temperature, top_k, top_p, seed)"
        )
    return (sampling or Sampling(**{"temperature": 0.0, **keywords})).check(vocab_size)


def _check_finite(step_tokens: np.ndarray, done: np.ndarray, t: int) -> None:
    """Raises NonFiniteLogits when a live row's token is `NONFINITE`."""
    bad = [b for b in range(len(done)) if not done[b] and step_tokens[b] == NONFINITE]
    if bad:
        raise NonFiniteLogits(
            f"the model's logits are NaN or infinite (new token {t} of prompt {bad[0]}): its "
            f"weights are broken (a checkpoint of a run that diverged?); nothing was generated "
            f"from them"
        )


def _prompt_rows(prompts) -> tuple[bool, list]:
    """(whether the prompts are strings, one list per prompt: the strings or int ids). Refuses,
    naming the prompt and the value, anything else (see `generate`)."""
    if isinstance(prompts, (str, bytes)):
        raise GenerationError("prompts must be a batch (a list of prompts): pass [prompt]")
    if hasattr(prompts, "ndim") and hasattr(prompts, "dtype") and prompts.ndim != 2:
        hint = ": for one prompt pass ids[None]" if prompts.ndim == 1 else ""  # numpy/jax/torch
        raise GenerationError(
            f"an array of prompts must be 2-D (batch, length), like "
            f"input_ids; got shape {tuple(prompts.shape)}{hint}"
        )
    try:
        prompts = list(prompts)
    except TypeError:
        raise GenerationError(
            f"prompts must be a list of strings or of token lists, not {type(prompts).__name__}"
        ) from None
    if not prompts:
        raise GenerationError("no prompts given")
    if all(is_int(t) for t in prompts):
        raise GenerationError(
            "prompts is one list of token ids, not a batch of prompts: pass [ids]"
        )
    kinds = {isinstance(p, str) for p in prompts}
    if kinds == {True, False}:
        raise GenerationError("prompts mix strings and token lists: give one kind")
    if kinds == {True}:
        for b, p in enumerate(prompts):
            if not p:
                raise GenerationError(f"prompt {b} is empty: give at least one character")
        return True, prompts
    rows = []
    for b, p in enumerate(prompts):
        if isinstance(p, (bytes, bytearray)):
            raise GenerationError(f"prompt {b} is bytes: decode it to a str, or give token ids")
        if hasattr(p, "ndim") and hasattr(p, "dtype"):
            a = np.asarray(p)
            if a.ndim != 1 or a.dtype.kind not in "iu":
                raise GenerationError(
                    f"prompt {b} is an array of {a.dtype} with shape {a.shape}: give a 1-D "
                    f"integer array of token ids (cast whole numbers with .astype(np.int32))"
                )
            rows.append([int(t) for t in a])
            continue
        try:
            items = list(p)
        except TypeError:
            raise GenerationError(
                f"prompt {b} is a {type(p).__name__}: give a string or a list of token ids"
            ) from None
        for i, t in enumerate(items):
            if not is_int(t):
                raise GenerationError(
                    f"prompt {b} has {t!r} ({type(t).__name__}) at position "
                    f"{i}: token ids must be integers, never converted"
                )
        rows.append([int(t) for t in items])
    return False, rows


def check_generation(config: ModelConfig, rows: Sequence[Sequence[int]], max_new_tokens: int):
    """Refuses, before any device work, what the cache cannot hold (XLA would clamp)."""
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    M, new = config.max_seq_len, int(max_new_tokens)
    for b, r in enumerate(rows):
        if len(r) == 0:
            raise GenerationError(f"prompt {b} is empty: give at least one token")
        bad = [t for t in r if not 0 <= t < config.vocab_size]
        if bad:
            raise GenerationError(
                f"prompt {b} has token ids outside [0, {config.vocab_size}): {bad[:5]}"
            )
        if len(r) + new <= M:
            continue
        # only the fixes that can work: each one alone must leave at least one slot
        fixes = ([f"shorten the prompt to <= {M - new} tokens"] if M - new >= 1 else []) + (
            [f"lower max_new_tokens to <= {M - len(r)}"] if M - len(r) >= 1 else []
        )
        fix = " or ".join(fixes) or (
            f"shorten the prompt and lower max_new_tokens: together they must be <= {M}"
        )
        if len(r) >= M:
            raise GenerationError(
                f"prompt {b} has {len(r)} tokens, but the cache holds "
                f"max_seq_len={M} positions including the new tokens: {fix}"
            )
        raise GenerationError(
            f"prompt {b} has {len(r)} tokens; with max_new_tokens={new} that is "
            f"{len(r) + new} positions, but the cache holds max_seq_len={M}: {fix}"
        )


# ---------------------------------------------------------------------------------------------
# Benchmark (the paper's protocol: random weights, prompt P, N new tokens, batch B, warm-up
# excluded, prefill and decode timed apart).


@functools.lru_cache(maxsize=None)
def device_bandwidth() -> tuple[float, str]:
    """Memory bandwidth of all devices together, in B/s, and how it was obtained."""
    d = jax.devices()[0]
    if d.platform == "gpu":
        chip = hardware.chip_of(d)
        if chip is None:
            return float("nan"), f"unknown bandwidth for {d.device_kind}"
        return (
            chip.hbm_bytes_per_s * jax.device_count(),
            f"{chip.name} datasheet x {jax.device_count()}",
        )
    # CPU: fake devices share the host's memory; measure a streaming read once.
    x = jax.device_put(jnp.ones((64, 1024, 1024), jnp.float32), d)  # 256 MiB
    total = jax.jit(lambda a: a.sum())
    total(x).block_until_ready()
    best = min(_timed(lambda: total(x).block_until_ready()) for _ in range(5))
    return x.nbytes / best, "host memory, measured: best of 5 jitted sums over 256 MiB"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _check_benchmark(batch, prompt_len: int, new_tokens: int) -> None:
    """`benchmark`'s sizes, each named with its command-line flag."""
    for name, flag, v, low in (
        ("batch", "batch", batch, 1),
        ("prompt_len", "prompt-len", prompt_len, 1),
        ("new_tokens", "max-new-tokens", new_tokens, 2),
    ):
        if not is_int(v) or v < low:
            raise GenerationError(
                f"benchmark {name}={v!r} (--{flag}) must be an integer >= {low}"
                + (
                    " (the first new token comes from prefill; decode is timed on the rest)"
                    if name == "new_tokens"
                    else ""
                )
            )


def benchmark(
    config: ModelConfig,
    mesh,
    *,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    repeats: int = 3,
    seed: int = 0,
) -> dict:
    """Prefill latency and decode throughput of `config` (random weights) on `mesh`."""
    _check_benchmark(batch, prompt_len, new_tokens)
    sharding.check_batch(batch, mesh)  # rows are split over the data axis as they are
    check_generation(config, [[0] * prompt_len], new_tokens)
    model = Transformer(config, mesh=mesh, rngs=nnx.Rngs(seed))
    decoder = Decoder(model, consume=True)
    settings = rows_to_device(RowSampling.of([Sampling()] * batch), mesh)
    S = cache_length(config, prompt_len, new_tokens)
    rng = np.random.default_rng(seed)
    tokens = to_device(
        rng.integers(0, min(config.vocab_size, 256), (batch, prompt_len), dtype=np.int32),
        mesh,
        P(DATA, None),
    )
    lengths = to_device(np.full(batch, prompt_len, np.int32), mesh, P(DATA))
    steps = [to_device(np.full(batch, t + 1, np.int32), mesh, P(DATA)) for t in range(new_tokens)]
    positions = [
        to_device(np.full(batch, prompt_len + t, np.int32), mesh, P(DATA))
        for t in range(new_tokens)
    ]

    def run():
        cache = KVCache.init(config, mesh, batch, S)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        tok, cache = decoder.prefill(cache, tokens, lengths, settings)
        tok.block_until_ready()
        t1 = time.perf_counter()
        for t in range(new_tokens - 1):
            tok, cache = decoder.decode_step(cache, tok, positions[t], settings, steps[t])
            if t % 8 == 7:  # bounded queue (module docstring), cheap on GPUs
                tok.block_until_ready()
        tok.block_until_ready()
        return t1 - t0, time.perf_counter() - t1

    t_compile = _timed(run)  # warm-up: compiles, not counted
    times = [run() for _ in range(repeats)]
    prefill_s = min(t[0] for t in times)
    decode_s = min(t[1] for t in times)
    steps = new_tokens - 1
    per_user = steps / decode_s
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # replicated weights are read on every rank: count what is actually read (by the step
    # program: a quantized model's float copy on a CPU, see Decoder)
    param_bytes_read = sum(
        x.addressable_data(0).nbytes * len(x.sharding.device_set)
        for x in jax.tree.leaves(decoder.state)
    )
    kv_read = KVCache.abstract(config, mesh, batch, S).nbytes  # each step reads all of it
    bandwidth, how = device_bandwidth()
    step_s = decode_s / steps
    return {
        "residual": config.residual,
        "ladder_layers": config.ladder_layers,
        "quantize": config.quantize,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "tp": sharding.tp_size(mesh),
        "devices": mesh.size,
        "prefill_ms": prefill_s * 1e3,
        "prefill_tokens_per_s": batch * prompt_len / prefill_s,
        "decode_ms_per_token": step_s * 1e3,
        "decode_tokens_per_s_per_user": per_user,
        "decode_tokens_per_s": per_user * batch,
        # every new token over prefill + decode, as `predict` and the paper's benchmark count
        "tokens_per_s": batch * new_tokens / (prefill_s + decode_s),
        "param_bytes": param_bytes,
        "bytes_read_per_step": param_bytes_read + kv_read,
        "roofline_fraction": (param_bytes_read + kv_read) / step_s / bandwidth,
        "bandwidth_bytes_per_s": bandwidth,
        "bandwidth_source": how,
        "first_run_s_incl_compile": t_compile,
    }
