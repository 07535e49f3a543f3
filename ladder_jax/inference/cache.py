"""The KV cache: a typed pytree, one key and one value array per layer, a row per sequence
(`KVCache`), or pools of pages with a block table (`PagedKV`, the server's). Their layouts, and
why to size a row with `cache_length`: docs/architecture.md, 'The KV cache layout' and 'The
paged KV cache'.

    cache = KVCache.init(config, mesh, batch=4, length=256)      # zeros, in their sharding
    shapes = KVCache.abstract(config, mesh, batch=4, length=256)  # ShapeDtypeStructs only
    paged = PagedKV.init(config, mesh, batch=16, length=4096, pages=1024)"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from ladder_jax.config import ModelConfig
from ladder_jax.model import layout
from ladder_jax.model.paged import PAGE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple  # L arrays (B, K', H, S)
    v: tuple  # L arrays (B, K', S, H)

    @staticmethod
    def abstract(config: ModelConfig, mesh, batch: int, length: int) -> "KVCache":
        """The cache as `jax.ShapeDtypeStruct`s carrying their shardings (nothing allocated)."""
        heads = layout.cache_kv_heads(config, layout.tp_size(mesh))
        H, dtype = config.head_dim, jnp.dtype(config.dtype)
        spec = NamedSharding(mesh, layout.CACHE_BKSH)
        k = jax.ShapeDtypeStruct((batch, heads, H, length), dtype, sharding=spec)
        v = jax.ShapeDtypeStruct((batch, heads, length, H), dtype, sharding=spec)
        return KVCache((k,) * config.n_layers, (v,) * config.n_layers)

    @staticmethod
    def init(config: ModelConfig, mesh, batch: int, length: int) -> "KVCache":
        """A zeroed cache for `batch` rows of `length` slots, created in its sharding."""
        shapes = KVCache.abstract(config, mesh, batch, length)
        k, v = (_zeros(x.shape, x.dtype, x.sharding) for x in (shapes.k[0], shapes.v[0]))
        return KVCache(
            tuple(k() for _ in range(config.n_layers)), tuple(v() for _ in range(config.n_layers))
        )

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def length(self) -> int:
        return self.v[0].shape[2]

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

    def pick(self, slots_n) -> "KVCache":
        """Rows `slots_n` (a slot past the batch: a copy of the last row, written nowhere)."""
        return jax.tree.map(lambda c: jnp.take(c, slots_n, axis=0, mode="clip"), self)

    def put(self, slots_n, picked: "KVCache") -> "KVCache":
        """This cache with rows `slots_n` := `picked`'s (slots past the batch dropped)."""
        return jax.tree.map(lambda c, r: c.at[slots_n].set(r, mode="drop"), self, picked)

    @staticmethod
    def shardings(mesh):
        """The cache's shardings (a pytree prefix), for a jit's out_shardings."""
        return NamedSharding(mesh, layout.CACHE_BKSH)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
    """A paged KV cache (`ladder_jax.model.paged`): per layer a key pool (P, K', H, page) and a
    value pool (P, K', page, H), and one block table (B, M) int32 for all layers: position p
    of row b is in page table[b, p // page]. Page 0 is the trash page. Meshes with data = 1.
    Who hands out pages: `ladder_jax.inference.pages.PagePool`."""

    k: tuple  # L arrays (P, K', H, page)
    v: tuple  # L arrays (P, K', page, H)
    table: jax.Array  # (B, M) int32

    @staticmethod
    def abstract(config, mesh, batch: int, length: int, pages: int, page: int = PAGE):
        """ShapeDtypeStructs of `pages` pages and a table of `batch` rows of `length` positions
        (rounded up to whole pages)."""
        if layout.data_size(mesh) != 1:
            raise ValueError(
                f"a paged cache needs a mesh with data=1, not {layout.data_size(mesh)}"
            )
        heads = layout.cache_kv_heads(config, layout.tp_size(mesh))
        H, dtype = config.head_dim, jnp.dtype(config.dtype)
        pool = NamedSharding(mesh, layout.POOL_PKHS)
        k = jax.ShapeDtypeStruct((pages, heads, H, page), dtype, sharding=pool)
        v = jax.ShapeDtypeStruct((pages, heads, page, H), dtype, sharding=pool)
        table = jax.ShapeDtypeStruct(
            (batch, -(-length // page)), jnp.int32, sharding=NamedSharding(mesh, layout.TABLE_BM)
        )
        return PagedKV((k,) * config.n_layers, (v,) * config.n_layers, table)

    @staticmethod
    def init(config, mesh, batch: int, length: int, pages: int, page: int = PAGE) -> "PagedKV":
        """Zeroed pools and a table of trash entries, created in their shardings."""
        shapes = PagedKV.abstract(config, mesh, batch, length, pages, page)
        k, v, t = (
            _zeros(x.shape, x.dtype, x.sharding) for x in (shapes.k[0], shapes.v[0], shapes.table)
        )
        n = config.n_layers
        return PagedKV(tuple(k() for _ in range(n)), tuple(v() for _ in range(n)), t())

    @property
    def batch(self) -> int:
        return self.table.shape[0]

    @property
    def page(self) -> int:
        return self.v[0].shape[2]

    @property
    def pages(self) -> int:
        return self.v[0].shape[0]

    @property
    def length(self) -> int:
        """Positions a row's table reaches."""
        return self.table.shape[1] * self.page

    @property
    def nbytes(self) -> int:
        return sum(x.size * jnp.dtype(x.dtype).itemsize for x in (*self.k, *self.v))

    def layers(self) -> list[tuple]:
        """The (k pool, v pool, table) of every layer, for `Transformer.forward_cached`."""
        return [(k, v, self.table) for k, v in zip(self.k, self.v)]

    @staticmethod
    def from_layers(layers) -> "PagedKV":
        return PagedKV(tuple(x[0] for x in layers), tuple(x[1] for x in layers), layers[0][2])

    def pick(self, slots_n) -> "PagedKV":
        """Rows `slots_n` (their table rows; a slot past the batch owns only the trash page)."""
        table = jnp.take(self.table, slots_n, axis=0, mode="fill", fill_value=0)
        return PagedKV(self.k, self.v, table)

    def put(self, slots_n, picked: "PagedKV") -> "PagedKV":
        """This cache with `picked`'s pools (what its rows wrote) and its own table."""
        del slots_n
        return PagedKV(picked.k, picked.v, self.table)

    def with_table(self, table) -> "PagedKV":
        return PagedKV(self.k, self.v, table)

    @staticmethod
    def shardings(mesh):
        """The cache's shardings (a pytree prefix), for a jit's out_shardings."""
        pool = NamedSharding(mesh, layout.POOL_PKHS)
        return PagedKV(pool, pool, NamedSharding(mesh, layout.TABLE_BM))


@functools.lru_cache(maxsize=64)
def _zeros(shape, dtype, sharding):
    """A jitted maker of zeros, one per shape and sharding: compiled once, not per cache."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cache_length(config: ModelConfig, longest_prompt: int, new_tokens: int) -> int:
    """Cache slots for a batch: room for the longest prompt and the new tokens, rounded so
    that nearby requests reuse compiled programs."""
    return min(round_up(longest_prompt + new_tokens, 64), config.max_seq_len)
