"""The KV cache: a typed pytree, one key and one value array per layer.

    cache = KVCache.init(config, mesh, batch=4, length=256)      # zeros, in their sharding
    shapes = KVCache.abstract(config, mesh, batch=4, length=256)  # ShapeDtypeStructs, no memory
    cache.nbytes, cache.batch, cache.length

Each array is (B, S, K', H) with K' = max(K, tp) kv heads (`sharding.cache_kv_heads`: under
tp > K every rank holds one copy of its kv head), batch rows on `data` and kv heads on `tp`
(`sharding.CACHE_BSKH`). The model reads and writes it as a list of (k, v) per layer
(`layers()` / `from_layers`): `Transformer.forward_cached` writes row b's new entries at slots
positions[b, 0] onwards.

Footgun: XLA clamps out-of-range dynamic updates silently, so a row written past `length`
overwrites its last slot: size it with `cache_length` and check lengths on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from ladder_jax.config import ModelConfig
from ladder_jax.model import sharding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple  # L arrays (B, S, K', H)
    v: tuple  # L arrays (B, S, K', H)

    @staticmethod
    def abstract(config: ModelConfig, mesh, batch: int, length: int) -> "KVCache":
        """The cache as `jax.ShapeDtypeStruct`s carrying their shardings (nothing allocated)."""
        shape = (batch, length, sharding.cache_kv_heads(config, sharding.tp_size(mesh)),
                 config.head_dim)
        kv = jax.ShapeDtypeStruct(shape, jnp.dtype(config.dtype),
                                  sharding=NamedSharding(mesh, sharding.CACHE_BSKH))
        return KVCache((kv,) * config.n_layers, (kv,) * config.n_layers)

    @staticmethod
    def init(config: ModelConfig, mesh, batch: int, length: int) -> "KVCache":
        """A zeroed cache for `batch` rows of `length` slots, created in its sharding."""
        kv = KVCache.abstract(config, mesh, batch, length).k[0]
        make = jax.jit(lambda: jnp.zeros(kv.shape, kv.dtype), out_shardings=kv.sharding)
        return KVCache(tuple(make() for _ in range(config.n_layers)),
                       tuple(make() for _ in range(config.n_layers)))

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def length(self) -> int:
        return self.k[0].shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (global) cache, replicated kv heads counted once per copy."""
        return sum(x.size * jnp.dtype(x.dtype).itemsize for x in (*self.k, *self.v))

    def layers(self) -> list[tuple]:
        """The (k, v) of every layer: what `Transformer.forward_cached` takes and returns."""
        return list(zip(self.k, self.v))

    @staticmethod
    def from_layers(layers) -> "KVCache":
        return KVCache(tuple(k for k, _ in layers), tuple(v for _, v in layers))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cache_length(config: ModelConfig, longest_prompt: int, new_tokens: int) -> int:
    """Cache slots for a batch: room for the longest prompt and the new tokens, rounded so
    that nearby requests reuse compiled programs."""
    return min(round_up(longest_prompt + new_tokens, 64), config.max_seq_len)
