"""The paged KV cache's host side: which pages of the pool each row holds, their refcounts,
and prefix caching by page. Pure Python, no device work: the engine writes the KV and keeps
each row's block table (page i of a row holds its positions [i * page, (i + 1) * page)).
Page 0 is the trash page: never handed out, so table entries pointing at it absorb writes
nobody reads. A page is free, in use (refcount >= 1) or evictable (refcount 0, its KV kept
for reuse; `allocate` takes it back least recently released first).

Prefix caching: a full block's KV depends on every token before it, so a page stands for a
chain, the exact token prefix ending with its block, interned: the id of block j is looked
up from (id of blocks 0..j-1, block j's tokens), exact and O(page) a block.
A chain has at most one registered page, the first one `register` gives it while it has none;
`lookup` follows a prompt's blocks through them. Registered pages are full, so they are shared
as they are: no row writes them again. Evicting a page forgets its chain's page: the chains
after it stop there until a row registers that block again (their pages go out in LRU order).

    pool = PagePool(pages=1024)
    table = pool.lookup(prompt, len(prompt) - 1)       # shared pages, reuse len(table) * 16
    table += pool.allocate(pages_needed - len(table))  # None when the pool is short
    pool.register(table, tokens_written)               # after each write, as the row grows
    pool.release(table)                                # the request ended"""

from __future__ import annotations

import collections
import operator
from collections.abc import Sequence


class PagePool:
    """Host-side bookkeeping of a pool of `pages` KV pages of `page` positions each (page 0
    is the trash page: usable ids are 1..pages-1); see the module docstring."""

    def __init__(self, pages: int, page: int = 16, cache_prefixes: bool = True):
        if not isinstance(pages, int) or pages < 2:
            raise ValueError(f"pages must be an int >= 2 (page 0 is the trash page), got {pages!r}")
        if not isinstance(page, int) or page < 1:
            raise ValueError(f"page must be an int >= 1, got {page!r}")
        self.pages, self.page, self.capacity = pages, page, pages - 1
        self.cache_prefixes = bool(cache_prefixes)
        self.queried_tokens = 0
        self.hit_tokens = 0
        self._ref = [0] * pages  # refcount of each page
        self._free = list(range(pages - 1, 0, -1))  # a stack: allocate pops 1, 2, ... first
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # evictable
        self._cid = [0] * pages  # chain id of the full block each page holds (0: none known)
        self._owner: dict[int, int] = {}  # chain id -> its registered page
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent id, block) -> id
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}  # id -> its _ids key
        self._depth: dict[int, int] = {}  # id -> blocks in its chain
        self._uses: dict[int, int] = {}  # id -> pages knowing it + chains extending it
        self._next_id = 1  # 0 is the empty chain (the parent of every first block)

    # ---- counts ---------------------------------------------------------------------------

    def available(self) -> int:
        """Pages `allocate` could hand out now: free ones plus evictable ones."""
        return len(self._free) + len(self._lru)

    def free_pages(self) -> int:
        """Pages holding nothing reusable: never used, or released while unregistered."""
        return len(self._free)

    def refcount(self, page: int) -> int:
        """How many holders (rows' tables) page `page` has."""
        return self._ref[self._check_page(page)]

    # ---- the engine's calls ---------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], limit: int) -> list[int]:
        """The registered pages of the longest chain of full blocks of tokens[:limit] (limit
        rounded down to a block), each taken (refcount + 1; an evictable page leaves the LRU).
        Counts len(tokens) in `queried_tokens` (the whole prompt) and the
        pages' positions in `hit_tokens`. With cache_prefixes=False: [] and no counting."""
        limit = _count("lookup: limit", limit)
        if not self.cache_prefixes:
            return []
        p, parent, found = self.page, 0, []
        for j in range(min(limit, len(tokens)) // p):
            cid = self._ids.get((parent, tuple(map(int, tokens[j * p : (j + 1) * p]))))
            if cid is None or cid not in self._owner:
                break
            found.append(self._owner[cid])
            parent = cid
        for pg in found:
            if not self._ref[pg]:
                del self._lru[pg]
            self._ref[pg] += 1
        self.queried_tokens += len(tokens)
        self.hit_tokens += len(found) * p
        return found

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh pages (refcount 1): free ones first, then the least recently released
        evictable ones (their chains lose their page). None, changing nothing, when fewer
        than `n` are available."""
        n = _count("allocate: n", n)
        if n > self.available():
            return None
        out = [self._free.pop() for _ in range(min(n, len(self._free)))]
        while len(out) < n:
            pg, _ = self._lru.popitem(last=False)
            del self._owner[self._cid[pg]]
            self._forget(pg)
            out.append(pg)
        for pg in out:
            self._ref[pg] = 1
        return out

    def register(self, pages: Sequence[int], tokens: Sequence[int]) -> None:
        """Row table `pages` holds the KV of `tokens` at positions 0..len(tokens)-1: each full
        block's page learns its chain, and becomes the chain's registered page if the chain has
        none (else it stays unregistered for good: first writer wins). Pages that know their
        chain already are skipped, so a call costs O(page) per new full block: the blocks before
        them are trusted, the last known one is checked against `tokens` (ValueError when it
        stands for another prefix). Does nothing with cache_prefixes=False."""
        if not self.cache_prefixes:
            return
        p = self.page
        full = len(tokens) // p
        if len(pages) < full:
            raise ValueError(f"register: {len(tokens)} tokens need {full} pages, got {len(pages)}")
        k = full
        while k and not self._cid[self._check_page(pages[k - 1])]:
            k -= 1
        new = [self._check_page(pg) for pg in pages[k:full]]
        if any(not self._ref[pg] for pg in new) or len(set(new)) < len(new):
            raise ValueError(f"register: pages {new} must be distinct pages the row holds")
        parent = self._cid[pages[k - 1]] if k else 0
        if k and (
            self._depth[parent] != k
            or self._key[parent][1] != tuple(map(int, tokens[(k - 1) * p : k * p]))
        ):
            raise ValueError(
                f"register: page {pages[k - 1]} holds another prefix than tokens[:{k * p}]"
            )
        for j, pg in enumerate(new, start=k):
            key = (parent, tuple(map(int, tokens[j * p : (j + 1) * p])))
            cid = self._ids.get(key)
            if cid is None:
                cid, self._next_id = self._next_id, self._next_id + 1
                self._ids[key], self._key[cid], self._depth[cid] = cid, key, j + 1
                self._uses[cid] = 0
                if parent:
                    self._uses[parent] += 1
            self._cid[pg] = cid
            self._uses[cid] += 1
            self._owner.setdefault(cid, pg)
            parent = cid

    def release(self, pages: Sequence[int]) -> None:
        """Refcount - 1 for each entry of `pages`. A page reaching 0 becomes evictable if it is
        registered, else free. Within one call the pages enter the LRU last to first, so a
        row's tail is evicted before its head. ValueError, changing nothing, when an entry
        would go below 0."""
        pages = [self._check_page(pg) for pg in pages]
        count = collections.Counter(pages)
        over = sorted(pg for pg, c in count.items() if c > self._ref[pg])
        if over:
            raise ValueError(f"release: pages {over} are released more often than held")
        for pg in reversed(pages):
            self._ref[pg] -= 1
            if self._ref[pg]:
                continue
            if self._owner.get(self._cid[pg]) == pg:
                self._lru[pg] = None
            else:
                self._forget(pg)
                self._free.append(pg)

    def check(self) -> None:
        """Asserts the internal invariants (AssertionError when one fails)."""
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free) and not free & lru and 0 not in free | lru
        assert self._ref[0] == 0 and self._cid[0] == 0
        for pg in range(1, self.pages):
            states = [pg in free, pg in lru, self._ref[pg] > 0]
            assert sum(states) == 1, f"page {pg}: free / evictable / in use = {states}"
            assert self._ref[pg] >= 0
            assert pg not in free or not self._cid[pg], f"free page {pg} knows a chain"
            if pg in lru:
                assert self._owner.get(self._cid[pg]) == pg, f"evictable page {pg} unregistered"
        for cid, pg in self._owner.items():
            assert self._cid[pg] == cid, f"chain {cid}'s page {pg} knows {self._cid[pg]}"
        uses = collections.Counter(c for c in self._cid if c)
        uses.update(key[0] for key in self._key.values() if key[0])
        assert dict(uses) == self._uses, "chain use counts"
        assert {cid: key for key, cid in self._ids.items()} == self._key
        for cid, (parent, block) in self._key.items():
            assert len(block) == self.page
            assert self._depth[cid] == (self._depth[parent] + 1 if parent else 1)
        assert self._owner.keys() <= self._key.keys() and self._depth.keys() == self._key.keys()

    # ---- inside ---------------------------------------------------------------------------

    def _check_page(self, page: int) -> int:
        try:
            pg = operator.index(page)
        except TypeError:
            pg = -1
        if not 1 <= pg < self.pages:
            raise ValueError(f"page {page!r} is not in the pool's range [1, {self.pages})")
        return pg

    def _forget(self, pg: int) -> None:
        """Page `pg` no longer holds its block: drop what it knew; a chain that no page knows
        and none extends is dropped (ids are never reused)."""
        cid, self._cid[pg] = self._cid[pg], 0
        while cid:
            self._uses[cid] -= 1
            if self._uses[cid]:
                break
            key = self._key.pop(cid)
            del self._ids[key], self._depth[cid], self._uses[cid]
            cid = key[0]


def _count(name: str, value: int) -> int:
    try:
        n = operator.index(value)
    except TypeError:
        n = -1
    if n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return n
