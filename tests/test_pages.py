"""PagePool against a simulated paged engine: rows look up their prompt's cached pages, grow by
random token runs (pages allocated as they go, under pressure), register, and release. The
test keeps every page's simulated KV (the token prefix each position was computed from) and a
brute-force reference of the pool (every registered page with the prefix it stands for, an
explicit LRU list), and compares every answer of the pool with it."""

import random

import numpy as np
import pytest

from ladder_jax.inference.pages import PagePool


class Reference:
    """The pool's rules by brute force: registered pages map to the token prefix they end."""

    def __init__(self, pages, page):
        self.page = page
        self.ref = dict.fromkeys(range(1, pages), 0)
        self.free = set(range(1, pages))
        self.lru = []  # evictable pages, least recently released first
        self.known = {}  # page -> the prefix its full block ends (registered or not)
        self.registered = {}  # page -> prefix, one page per prefix

    def lookup(self, tokens, limit):
        out, p = [], self.page
        for d in range(1, min(limit, len(tokens)) // p + 1):
            hits = [pg for pg, pre in self.registered.items() if pre == tuple(tokens[: d * p])]
            assert len(hits) <= 1
            if not hits:
                break
            out.append(hits[0])
        for pg in out:
            if not self.ref[pg]:
                self.lru.remove(pg)
            self.ref[pg] += 1
        return out

    def allocate(self, got, n):
        """Checks `got` (what the pool returned for n) and applies it."""
        if n > len(self.free) + len(self.lru):
            assert got is None
            return
        k = min(n, len(self.free))
        assert len(got) == n and set(got[:k]) <= self.free and len(set(got[:k])) == k
        assert got[k:] == self.lru[: n - k]  # least recently released first
        self.free -= set(got[:k])
        del self.lru[: n - k]
        for pg in got:
            self.known.pop(pg, None)
            self.registered.pop(pg, None)
            self.ref[pg] = 1

    def register(self, table, tokens):
        p = self.page
        for i in range(len(tokens) // p):
            prefix = tuple(tokens[: (i + 1) * p])
            if table[i] in self.known:
                assert self.known[table[i]] == prefix
                continue
            self.known[table[i]] = prefix
            if prefix not in self.registered.values():
                self.registered[table[i]] = prefix

    def release(self, table):
        for pg in reversed(table):
            self.ref[pg] -= 1
            if not self.ref[pg]:
                if pg in self.registered:
                    self.lru.append(pg)
                else:
                    self.free.add(pg)
                    self.known.pop(pg, None)


class Sim:
    """A paged engine over the pool and the reference, checking both after every call."""

    def __init__(self, rng, pages, page, vocab):
        self.rng, self.page, self.vocab = rng, page, vocab
        self.pool, self.ref = PagePool(pages, page), Reference(pages, page)
        self.kv = {pg: [None] * page for pg in range(1, pages)}  # prefix per position
        self.rows = {}  # id -> [table, tokens written, prompt tokens to write, decode runs left]
        self.foreign = []  # tables held outside rows (allocations under pressure)
        self.stems = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 5 * page))]]
        self.stems += [[rng.randrange(vocab) for _ in range(rng.randrange(0, 3 * page))]]
        self.queried = self.hit = self.nones = self.evicted = 0
        self.next_row = 0

    def start(self):
        rng = self.rng
        prompt = rng.choice(self.stems)[: rng.randrange(0, 6 * self.page)]
        prompt = prompt + [rng.randrange(self.vocab) for _ in range(rng.randrange(1, 8))]
        limit = len(prompt) - 1 if rng.random() < 0.8 else rng.randrange(0, len(prompt) + 3)
        got = self.pool.lookup(prompt, limit)
        assert got == self.ref.lookup(prompt, limit), (prompt, limit, self.ref.registered)
        for i, pg in enumerate(got):  # the shared KV is the prompt's
            start = i * self.page
            assert self.kv[pg] == [tuple(prompt[: start + o + 1]) for o in range(self.page)]
        self.queried, self.hit = self.queried + len(prompt), self.hit + len(got) * self.page
        if rng.random() < 0.1:  # admission abandoned: the pages go back at once
            self.release(got)
            return
        reused = len(got) * self.page
        self.rows[self.next_row] = [got, prompt[:reused], prompt[reused:], rng.randrange(0, 4)]
        self.next_row += 1

    def advance(self, rid):
        rng, p = self.rng, self.page
        table, tokens, todo, runs = self.rows[rid]
        if todo:
            n = rng.randrange(1, 2 * p + 2)
            run, self.rows[rid][2] = todo[:n], todo[n:]
        elif runs:
            run = [rng.randrange(self.vocab) for _ in range(rng.randrange(1, p + 2))]
            self.rows[rid][3] -= 1
        else:
            return self.end(rid)
        need = -(-(len(tokens) + len(run)) // p) - len(table)
        if need > 0:
            got = self.allocate(need)
            if got is None:
                self.rows[rid][2] = run + self.rows[rid][2] if todo else self.rows[rid][2]
                if rng.random() < 0.3:  # preempted
                    self.end(rid)
                return
            table += got
        for pos in range(len(tokens), len(tokens) + len(run)):
            pg = table[pos // p]
            # only the row's own unregistered page is written
            assert self.ref.ref[pg] == 1 and pg not in self.ref.registered
            self.kv[pg][pos % p] = tuple(tokens + run[: pos - len(tokens) + 1])
        tokens += run
        for _ in range(rng.choice([1, 1, 2])):
            upto = tokens if rng.random() < 0.8 else tokens[: rng.randrange(0, len(tokens) + 1)]
            self.pool.register(table, upto)
            self.ref.register(table, upto)

    def allocate(self, n):
        lru_before = len(self.ref.lru)
        got = self.pool.allocate(n)
        self.ref.allocate(got, n)
        self.nones += got is None
        self.evicted += got is not None and len(self.ref.lru) < lru_before
        return got

    def release(self, table):
        self.pool.release(table)
        self.ref.release(table)

    def end(self, rid):
        self.release(self.rows.pop(rid)[0])

    def step(self):
        rng = self.rng
        r = rng.random()
        if r < 0.25 and len(self.rows) < 5:
            self.start()
        elif r < 0.85 and self.rows:
            self.advance(rng.choice(sorted(self.rows)))
        elif r < 0.92:
            got = self.allocate(rng.randrange(0, 4))
            if got:
                self.foreign.append(got)
        elif self.foreign:
            self.release(self.foreign.pop(rng.randrange(len(self.foreign))))
        elif self.rows:
            self.end(rng.choice(sorted(self.rows)))
        self.verify()

    def verify(self):
        self.pool.check()
        holders = dict.fromkeys(self.ref.ref, 0)
        for table in [row[0] for row in self.rows.values()] + self.foreign:
            for pg in table:
                holders[pg] += 1
        assert holders == self.ref.ref
        assert {pg: self.pool.refcount(pg) for pg in holders} == holders
        in_use = {pg for pg, c in holders.items() if c}
        assert not in_use & self.ref.free and not in_use & set(self.ref.lru)
        assert self.pool.free_pages() == len(self.ref.free)
        assert self.pool.available() == len(self.ref.free) + len(self.ref.lru)
        assert (self.pool.queried_tokens, self.pool.hit_tokens) == (self.queried, self.hit)


@pytest.mark.parametrize("seed", range(16))
def test_random_operations_match_brute_force(seed):
    rng = random.Random(seed)
    page = [1, 2, 3, 4][seed % 4]
    sim = Sim(rng, pages=4 + seed % 9, page=page, vocab=2 + seed % 2)
    for _ in range(800):
        sim.step()
    for rid in sorted(sim.rows):
        sim.end(rid)
    while sim.foreign:
        sim.release(sim.foreign.pop())
    sim.verify()
    assert sim.pool.available() == sim.pool.capacity
    # the run exercised reuse, a short pool and eviction
    assert sim.hit > 0 and sim.nones > 0 and sim.evicted > 0, (sim.hit, sim.nones, sim.evicted)


def written(pool, tokens):
    """A table for `tokens` of fresh pages, registered as the engine would after writing."""
    table = pool.allocate(-(-len(tokens) // pool.page))
    pool.register(table, tokens)
    return table


def test_constructor_errors():
    for kwargs in [{"pages": 1}, {"pages": 0}, {"pages": 4.0}, {"pages": 4, "page": 0}]:
        with pytest.raises(ValueError):
            PagePool(**kwargs)
    pool = PagePool(3, page=4)
    assert (pool.capacity, pool.page, pool.available(), pool.free_pages()) == (2, 4, 2, 2)


def test_allocate_hands_out_free_pages_then_none():
    pool = PagePool(4, page=2)
    assert pool.allocate(0) == []
    a = pool.allocate(2)
    assert sorted(a) == [1, 2] and [pool.refcount(pg) for pg in a] == [1, 1]
    assert pool.allocate(2) is None and pool.available() == 1  # nothing changed
    assert pool.allocate(1) == [3] and pool.allocate(1) is None
    for bad in (-1, 1.0, None):
        with pytest.raises(ValueError, match="n must be an int"):
            pool.allocate(bad)
    pool.release(a)
    assert pool.free_pages() == 2  # unregistered: straight back to free
    pool.check()


def test_lookup_returns_full_cached_blocks_and_counts():
    pool = PagePool(8, page=2)
    table = written(pool, [1, 2, 3, 4, 5])  # blocks [1, 2], [3, 4]; 5 is partial
    pool.release(table)
    assert pool.available() == 7 and pool.free_pages() == 5  # two evictable, one freed
    got = pool.lookup([1, 2, 3, 4, 5, 6], 5)
    assert got == table[:2] and [pool.refcount(pg) for pg in got] == [1, 1]
    assert pool.lookup([1, 2, 3, 4], 3) == table[:1]  # limit rounds down to a block
    assert pool.lookup([1, 2, 9, 9], 4) == table[:1]
    assert pool.lookup([1, 2, 3, 4], 1) == [] and pool.lookup([2, 1], 2) == []
    assert pool.lookup([1, 2], 10) == table[:1]  # limit past the tokens: all of them
    assert pool.refcount(table[0]) == 4 and pool.refcount(table[1]) == 1
    assert pool.queried_tokens == 6 + 4 + 4 + 4 + 2 + 2
    assert pool.hit_tokens == 4 + 2 + 2 + 2
    for bad in (-1, 2.0):
        with pytest.raises(ValueError, match="limit must be an int"):
            pool.lookup([1, 2], bad)
    assert pool.lookup([1, 2], np.int64(2)) == table[:1]
    pool.release(table[:1])
    pool.check()


def test_first_writer_wins_and_the_loser_stays_unregistered():
    pool = PagePool(8, page=2)
    a = written(pool, [1, 2, 3])
    b = written(pool, [1, 2, 4, 4])  # block 0 repeats a's: b[0] stays unregistered
    assert pool.lookup([1, 2, 4, 4, 0], 4) == [a[0], b[1]]  # b's second block is registered
    pool.release([a[0], b[1]])
    pool.release(a)  # a[0] evictable (registered), a[1] free (partial block)
    assert pool.free_pages() == 4 and pool.available() == 5
    assert pool.allocate(5)[-1] == a[0]  # free pages first, then the cached a[0]
    assert pool.lookup([1, 2, 4, 4], 4) == []  # b[0] holds [1, 2] but was never registered
    pool.register(b, [1, 2, 4, 4, 5])  # considered before: still not registered
    assert pool.lookup([1, 2, 4, 4], 4) == []
    pool.release(b)  # b[1] stays cached, unreachable until [1, 2] is registered again
    c = written(pool, [1, 2])
    assert pool.lookup([1, 2, 4, 4], 4) == [c[0], b[1]]
    pool.check()


def test_release_fills_the_lru_tail_first():
    pool = PagePool(6, page=1)
    a = written(pool, [1, 2, 3])
    b = written(pool, [7, 8])
    pool.release(b)
    pool.release(a)
    # least recently released first; within one call, the row's tail before its head
    assert pool.allocate(5) == [b[1], b[0], a[2], a[1], a[0]]
    pool.check()


def test_lookup_takes_pages_out_of_the_lru():
    pool = PagePool(4, page=1)
    a = written(pool, [1, 2])
    pool.release(a)
    assert pool.lookup([1, 2], 2) == a  # taken again: not evictable while held
    assert pool.allocate(2) is None and pool.allocate(1) == [3]
    pool.release(a)
    assert pool.allocate(2) == [a[1], a[0]]
    pool.check()


def test_eviction_drops_the_page_and_a_rewrite_reconnects_the_chain():
    pool = PagePool(5, page=2)
    a = written(pool, [1, 2, 3, 4])
    pool.release(a[1:])  # a[1] evictable, a[0] still held
    pool.release(a[:1])  # a[0] evictable, released last
    assert pool.allocate(3) == [3, 4, a[1]]  # free pages first, then a[1]
    assert pool.lookup([1, 2, 3, 4, 5], 5) == [a[0]]
    pool.release([a[0], 3, 4])
    b = pool.allocate(2)
    assert a[0] not in b  # free pages were there: the cached head stays
    pool.register(b, [1, 2, 3, 4])  # b[0] loses to a[0]; b[1] takes the evicted chain
    assert pool.lookup([1, 2, 3, 4, 0], 5) == [a[0], b[1]]
    pool.check()


def test_register_is_incremental_and_idempotent():
    pool = PagePool(6, page=2)
    table = pool.allocate(3)
    for n in range(7):
        pool.register(table, [5, 6, 7, 8, 9, 9][:n])
        pool.register(table, [5, 6, 7, 8, 9, 9][:n])
        pool.check()
    pool.register(table, [5, 6])  # shorter than what it knows: nothing
    c = pool.lookup([5, 6, 7, 8, 9, 9, 0], 7)
    assert c == table and pool.refcount(table[0]) == 2
    pool.register(c + [0, 0], [5, 6, 7, 8, 9, 9, 1])  # a longer table, same pages known
    pool.check()


def test_register_errors():
    pool = PagePool(6, page=2)
    table = written(pool, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="another prefix"):
        pool.register(table, [1, 2, 3, 5])  # table[1] already stands for [1, 2, 3, 4]
    with pytest.raises(ValueError, match="another prefix"):
        pool.register(table[1:] + table[:1], [3, 4, 5, 6])  # a known page at a wrong place
    with pytest.raises(ValueError, match="need 3 pages"):
        pool.register(table, [1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="distinct pages the row holds"):
        pool.register(table + [5], [1, 2, 3, 4, 5, 6])  # page 5 is free
    (new,) = pool.allocate(1)
    with pytest.raises(ValueError, match="distinct pages the row holds"):
        pool.register([new, new], [1, 1, 1, 1])
    for bad in (0, 6, -1, 1.0):
        with pytest.raises(ValueError, match="not in the pool's range"):
            pool.register([bad], [1, 1])
    pool.check()


def test_release_errors_change_nothing():
    pool = PagePool(4, page=2)
    a = written(pool, [1, 2])
    with pytest.raises(ValueError, match="released more often than held"):
        pool.release([a[0], a[0]])
    with pytest.raises(ValueError, match="released more often than held"):
        pool.release([3])
    with pytest.raises(ValueError, match="not in the pool's range"):
        pool.release([0])
    assert pool.refcount(a[0]) == 1
    with pytest.raises(ValueError, match="not in the pool's range"):
        pool.refcount(4)
    pool.check()


def test_numpy_tables_and_tokens():
    pool = PagePool(4, page=2)
    table = np.array(pool.allocate(2), np.int32)
    pool.register(table, np.array([1, 2, 3, 4], np.int32))
    pool.release(table)
    assert pool.lookup(np.array([1, 2, 3, 4, 5]), 5) == [int(table[0]), int(table[1])]
    pool.check()


def test_without_prefix_caching():
    pool = PagePool(4, page=2, cache_prefixes=False)
    a = written(pool, [1, 2, 3, 4])
    pool.release(a)
    assert pool.free_pages() == 3  # nothing was registered
    assert pool.lookup([1, 2, 3, 4], 4) == []
    assert (pool.queried_tokens, pool.hit_tokens) == (0, 0)
    pool.check()


def test_check_catches_a_broken_state():
    pool = PagePool(4, page=2)
    pool.allocate(1)
    pool._free.append(1)  # in use and free at once
    with pytest.raises(AssertionError):
        pool.check()
