"""Continuous batching over the jitted decode step: a fixed number of slots over one paged KV
cache, each slot's request holding the pages it has grown into (`PagePool`: pages shared by
requests with a common prefix, handed out as rows grow, a request preempted and recomputed later
when none are left). Each round (a `Plan`) runs the decode steps (or one step verifying
prompt-lookup drafts) of the slots decoding, then one prompt chunk per slot still prefilling.
Rounds, pages, prefix reuse, speculation, processes and limits: docs/inference.md, 'Inside the
server'.

    engine = Engine(model, slots=16, max_queue=64); engine.start(); engine.submit(request)"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from ladder_jax.inference import lookup
from ladder_jax.inference.cache import PagedKV
from ladder_jax.inference.generation import (
    TOP_LOGPROBS,
    Decoder,
    rows_to_device,
    to_device,
    to_host,
)
from ladder_jax.inference.pages import PagePool
from ladder_jax.inference.plan import DECODE, IDLE, SCORED, VERIFY, Chunk, Plan, PlanShape
from ladder_jax.inference.sampling import NONFINITE, GenerationError, RowSampling, Sampling
from ladder_jax.model import layout, paged
from ladder_jax.model.transformer import Transformer

PREFILL_TOKENS = 8192  # prompt tokens (padded) one prefill program holds at most
WARM_PROMPT_TOKENS = 512  # warm-up compiles one-prompt prefills up to this bucket


class EngineFull(GenerationError):
    """The waiting queue is full (or the engine is draining): try again later."""


@dataclasses.dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    eos_id: int | None = None
    on_token: Callable[[int], None] = lambda token: None
    on_finish: Callable[[str], None] = lambda reason: None  # length stop cancelled error
    # nonfinite (the model's logits were NaN or infinite)
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False
    rows: RowSampling | None = None  # its sampling settings (set by submit)
    # scoring: logprobs=N (0..TOP_LOGPROBS) records, before each on_token, (log p, the top N
    # ids, their log p) in `scores`; with echo too, `prompt_scores` holds the same for the
    # prompt's tokens 1.. (set before the first token). max_tokens=0: prefill only, no token
    logprobs: int | None = None
    echo: bool = False
    scores: list = dataclasses.field(default_factory=list)
    prompt_scores: list | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (set on admission)
    resume: list = dataclasses.field(default_factory=list)  # tokens produced before a preemption


def prefill_group(n: int) -> int:
    """The rows of a prefill of n admitted prompts: the next power of two >= n."""
    return 1 << (n - 1).bit_length()


def prefill_rows(T: int) -> int:
    """The most prompts of bucket T one prefill program takes: PREFILL_TOKENS in all (a power
    of two, at least one), so long prompts never make one huge program."""
    return prefill_group(max(1, PREFILL_TOKENS // T + 1)) // 2 if T < PREFILL_TOKENS else 1


def prompt_bucket(n: int, length: int) -> int:
    """The padded prompt length of a prefill: the next power of two >= n (>= 16, <= length)."""
    return min(max(16, 1 << (n - 1).bit_length()), length)


class Engine:
    def __init__(
        self,
        model: Transformer,
        *,
        slots: int = 16,
        max_len: int | None = None,
        max_queue: int = 64,
        prefills_per_step: int = 4,
        steps_per_plan: int = 2,
        chunk: int = 256,
        prefix_block: int | None = 16,
        speculate: int = 0,
        pages: int | None = None,
        heartbeat_s: float = 1.0,
        consume: bool = False,
    ):
        mesh = model.mesh
        if layout.data_size(mesh) != 1:
            raise GenerationError(
                f"the server batches over slots of one cache: use a mesh "
                f"with data=1 (got data={layout.data_size(mesh)})"
            )
        for name, v, low in (
            ("steps_per_plan", steps_per_plan, 1),
            ("chunk", chunk, 1),
            ("speculate", speculate, 0),
            ("prefix_block", 1 if prefix_block is None else prefix_block, 1),
        ):
            if v < low:
                raise GenerationError(f"{name} must be >= {low}, got {v}")
        c = model.config
        self.model, self.mesh, self.config = model, mesh, c
        self.slots, self.max_queue = slots, max_queue
        self.length = min(max_len or c.max_seq_len, c.max_seq_len)  # positions a request may use
        self.prefills_per_step, self.heartbeat_s = prefills_per_step, heartbeat_s
        self.steps_per_plan, self.speculate = steps_per_plan, speculate
        self.chunk = min(chunk, self.length)
        self.admit = prefills_per_step * steps_per_plan  # chunks per round: same rate per step
        # pages of `page` positions (a prefix is reused in whole pages); by default as many as
        # every slot filled to `length` needs, plus the trash page
        self.page = prefix_block or paged.PAGE
        M = -(-self.length // self.page)
        pages = slots * M + 1 if pages is None else pages
        if pages < M + 1:
            raise GenerationError(
                f"pages={pages}: one request of {self.length} positions needs {M} pages of "
                f"{self.page} (+1, the trash page)"
            )
        self.pool = PagePool(pages, self.page, cache_prefixes=prefix_block is not None)
        self.shape = PlanShape(
            slots, self.admit, max(self.admit * self.chunk, self.length), speculate, M
        )
        self.decoder = Decoder(model, consume=consume)  # consume: the engine owns model
        self.cache = PagedKV.init(c, mesh, slots, self.length, pages, self.page)
        self.table = np.zeros((slots, M), np.int32)  # each row's pages (0: the trash page)
        self.sent = self.table.copy()  # the table the device cache holds
        self.held: list[list[int]] = [[] for _ in range(slots)]  # each row's pages, in order
        self.lead = jax.process_index() == 0
        self.many = jax.process_count() > 1
        # host state of the slots (process 0)
        self.owner: list[Request | None] = [None] * slots
        self.last = np.zeros(slots, np.int32)  # each slot's newest token
        self.length_b = np.zeros(slots, np.int32)  # prompt lengths
        self.fed_b = np.zeros(slots, np.int32)  # prompt tokens planned into the cache
        self.target_b = np.zeros(slots, np.int32)  # tokens to prefill (+ a resumed one's own)
        self.reserved_b = np.zeros(slots, bool)  # all its pages taken at admission (scored)
        self.order_b = np.zeros(slots, np.int64)  # admission order (the newest is preempted)
        self.admissions = 0
        self.count_b = np.zeros(slots, np.int32)  # tokens produced so far
        self.seq: list[list[int]] = [[] for _ in range(slots)]  # prompt + tokens produced
        self.prefilling: list[int] = []  # slots whose prompt is not all in, oldest first
        self.released: list[tuple] = []  # (pages, tokens written) of rows freed this round
        self.settings = RowSampling.empty(slots)
        self.queue: collections.deque[Request] = collections.deque()
        self.lock = threading.Condition()
        self.admitting, self.stopping = True, False
        self.thread: threading.Thread | None = None
        self.steps = 0  # decode steps run
        self.drafted_tokens = self.accepted_tokens = 0  # speculation
        self.preemptions = 0  # requests sent back to the queue for want of pages
        self.error: str | None = None  # why the loop died, if it did

    @property
    def prefix_queried_tokens(self) -> int:
        return self.pool.queried_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        return self.pool.hit_tokens

    # -- process 0: requests in ---------------------------------------------------------------

    def check(self, req: Request) -> None:
        """Refuses what the cache cannot hold (before any device work)."""
        n, c = len(req.prompt), self.config
        if n == 0:
            raise GenerationError("the prompt is empty: give at least one token")
        bad = [t for t in req.prompt if not 0 <= t < c.vocab_size]
        if bad:
            raise GenerationError(
                f"the prompt has token ids outside [0, {c.vocab_size}): {bad[:5]}"
            )
        if req.logprobs is not None and not (0 <= req.logprobs <= TOP_LOGPROBS):
            raise GenerationError(f"logprobs={req.logprobs} must be from 0 to {TOP_LOGPROBS}")
        if req.max_tokens < 0 or (req.max_tokens == 0 and not req.echo):
            raise GenerationError(
                f"max_tokens={req.max_tokens} must be >= 1 (0: with echo, to score the prompt only)"
            )
        if n + req.max_tokens > self.length:
            raise GenerationError(
                f"the prompt has {n} tokens; with max_tokens={req.max_tokens} that is "
                f"{n + req.max_tokens} positions, but a slot holds {self.length}: shorten the "
                f"prompt or lower max_tokens"
            )

    def submit(self, req: Request) -> None:
        self.submit_all([req])

    def submit_all(self, reqs: list[Request]) -> None:
        """Queues every request or none: each checked first (GenerationError); more than the
        queue can ever hold is a GenerationError that says so, a queue too full now for all
        of them is EngineFull (try again later)."""
        for req in reqs:
            self.check(req)
            req.sampling.check(self.config.vocab_size)
            req.rows = RowSampling.of([req.sampling], rows=[0])
        with self.lock:
            if not self.admitting:
                raise EngineFull("the server is shutting down")
            if len(reqs) > 1 and len(reqs) > self.max_queue:
                raise GenerationError(
                    f"a batch of {len(reqs)} prompts can never fit: this server queues at "
                    f"most {self.max_queue} requests; send at most {self.max_queue} prompts "
                    f"per request"
                )
            if len(self.queue) + len(reqs) > self.max_queue:
                raise EngineFull(
                    f"all {self.slots} slots are busy and {len(self.queue)} "
                    f"requests wait: try again later"
                )
            self.queue.extend(reqs)
            self.lock.notify()

    def cancel(self, req: Request) -> None:
        """Frees the request's slot before the next step; a queued one leaves the queue at
        once (its place is free for the next request)."""
        req.cancelled = True
        with self.lock:
            queued = req in self.queue
            if queued:
                self.queue.remove(req)
            self.lock.notify()
        if queued:
            req.on_finish("cancelled")

    @property
    def busy(self) -> int:
        return sum(o is not None for o in self.owner)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    # -- the loop -----------------------------------------------------------------------------

    def start(self) -> None:
        self.thread = threading.Thread(target=self._lead_loop, name="ladder-engine", daemon=True)
        self.thread.start()

    def drain(self, timeout_s: float) -> None:
        """Stops admitting, lets running requests finish for up to `timeout_s`, cancels the
        rest (queued ones at once), stops the loop (and the followers)."""
        with self.lock:
            self.admitting = False
            queued, self.queue = list(self.queue), collections.deque()
        for req in queued:
            req.cancelled = True
            req.on_finish("cancelled")
        deadline = time.monotonic() + timeout_s
        while self.busy and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.02)
        for req in self.owner:
            if req is not None:
                req.cancelled = True
        with self.lock:
            self.stopping = True
            self.lock.notify()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def _lead_loop(self) -> None:
        try:
            self._lead_steps()
        except BaseException as e:  # a device failure: fail every request, say so in /health
            self.error = f"{type(e).__name__}: {e}"
            with self.lock:
                self.admitting = False
                for i, req in enumerate(self.owner):
                    if req is not None:
                        self._free(i, "error")
                for req in self.queue:
                    req.on_finish("error")
                self.queue.clear()
            raise

    def _lead_steps(self) -> None:
        while True:
            with self.lock:
                while not (self.stopping or self.queue or self.busy):
                    if not self.lock.wait(timeout=self.heartbeat_s) and self.many:
                        break  # a heartbeat for the followers
                plan = self._plan().to_array(self.shape)
            if self.many:
                multihost_utils.broadcast_one_to_all(plan)
            if not self._execute(Plan.from_array(plan, self.shape)):
                return

    def follow(self) -> None:
        """Processes other than 0: run process 0's plans until it stops."""
        zeros = np.zeros(self.shape.size, np.int32)
        while self._execute(
            Plan.from_array(np.asarray(multihost_utils.broadcast_one_to_all(zeros)), self.shape)
        ):
            pass

    # -- process 0: the next round ------------------------------------------------------------

    def _plan(self) -> Plan:
        """The next round (docs/inference.md, 'Inside the server'): frees cancelled slots, gives
        the rows running the pages this round writes (preempting the newest request when the
        pool runs out), the decode part over the slots decoding, a chunk for each slot still
        prefilling, then new requests from the queue, each claiming a free row, its cached
        prefix pages and the pages of its first chunk, up to `admit` chunks (called with the
        lock held)."""
        for i, req in enumerate(self.owner):
            if req is not None and req.cancelled:
                self._free(i, "cancelled")
        self._release()
        if not self.stopping:
            self._grow()
        B, K = self.slots, self.speculate
        busy_b = np.array([o is not None and self.count_b[i] > 0 for i, o in enumerate(self.owner)])
        busy_b &= self.fed_b >= self.target_b  # a resumed request prefills first
        decode = DECODE if busy_b.any() and not self.stopping else IDLE
        if decode and any(self.owner[i].logprobs is not None for i in np.flatnonzero(busy_b)):
            decode = SCORED
        s = self.settings
        plan = Plan(
            not self.stopping,
            decode,
            self.last.copy(),
            # rows not decoding: at their frontier (`_idle_positions`, once the round is planned)
            np.where(busy_b, self.length_b + self.count_b - 1, 0).astype(np.int32),
            RowSampling(s.keys.copy(), s.temperature.copy(), s.top_k.copy(), s.top_p.copy()),
            self.count_b.copy(),
            busy_b,
            np.zeros((B, K), np.int32),
            np.zeros(B, np.int32),
            self.table,
        )
        if decode == DECODE and K:
            self._draft(plan)
        if not self.stopping:
            for i in list(self.prefilling):  # (a final chunk leaves the list)
                plan.chunks.append(self._next_chunk(i))
            self._admit(plan)
            self._idle_positions(plan)
        plan.table_bm = self.table.copy()
        return plan

    def _grow(self) -> None:
        """Pages for what this round writes, oldest request first: a decoding row's next
        steps (not past its last token), a prefilling row's next chunk. When the pool is out
        of pages, the newest request is preempted (`_preempt`) until the row's fit, or the row
        is that newest request itself."""
        span = max(self.steps_per_plan, self.speculate + 1 if self.speculate else 0)
        for i in sorted(np.flatnonzero([o is not None for o in self.owner]), key=self._age):
            req = self.owner[i]
            if req is None or self.reserved_b[i]:
                continue
            if self.fed_b[i] < self.target_b[i]:  # prefilling: its next chunk
                need = self.fed_b[i] + min(self.chunk, self.target_b[i] - self.fed_b[i])
            else:  # its positions this round, up to the last token's (never written)
                last = self.length_b[i] + req.max_tokens - 1
                need = min(self.length_b[i] + self.count_b[i] - 1 + span, last)
            self._pages_for(i, int(need))

    def _age(self, i) -> int:
        return int(self.order_b[i])

    def _pages_for(self, i: int, positions: int) -> bool:
        """Row i's pages cover `positions`; preempts the newest requests while the pool is
        short. False: row i itself was preempted."""
        want = -(-positions // self.page) - len(self.held[i])
        while want > 0:
            got = self.pool.allocate(want)
            if got is not None:
                self._own(i, got)
                return True
            victims = [
                j for j, o in enumerate(self.owner) if o is not None and not self.reserved_b[j]
            ]
            victim = max(victims, key=self._age)
            self._preempt(victim)
            if victim == i:
                return False
        return True

    def _own(self, i: int, pages: list[int]) -> None:
        n = len(self.held[i])
        self.held[i] += pages
        self.table[i, n : n + len(pages)] = pages

    def _written(self, i: int) -> int:
        """Positions of row i that hold its sequence's KV."""
        if self.fed_b[i] < self.target_b[i] or self.count_b[i] == 0:
            return int(min(self.fed_b[i], len(self.seq[i])))
        return int(min(len(self.seq[i]), self.length_b[i] + self.count_b[i] - 1))

    def _preempt(self, i: int) -> None:
        """Sends row i's request back to the front of the queue, its pages released (its full
        blocks kept in the prefix cache, so that its recompute is mostly a cache hit); it
        resumes later with what it produced as part of its prompt (`Request.resume`)."""
        req = self.owner[i]
        req.resume = self.seq[i][len(req.prompt) :]
        self._vacate(i)
        self._release()
        self.queue.appendleft(req)
        self.preemptions += 1

    def _vacate(self, i: int) -> None:
        """Empties slot i; its pages go back to the pool after the round (`_release`)."""
        self.released.append((self.held[i], self.seq[i][: self._written(i)]))
        self.held[i] = []
        self.table[i] = 0
        self.owner[i] = None
        self.settings.temperature[i], self.settings.top_k[i] = 0, 0
        self.count_b[i], self.last[i], self.length_b[i], self.fed_b[i] = 0, 0, 0, 0
        self.target_b[i], self.reserved_b[i] = 0, False
        if i in self.prefilling:
            self.prefilling.remove(i)

    def _idle_positions(self, plan: Plan) -> None:
        """The rows that do not decode in the round's decode part still run it: they go in as
        idle (position -(p + 1), `attention.attend_rotated`), writing from their frontier p,
        the first position whose KV nothing needs (a chunk this round: its start, which the
        chunk then rewrites; a prompt still coming in: where it stands; a free row: 0, in the
        trash page its table holds) and attending to nothing, so they never lengthen the
        decode attention, which reads every row up to the furthest position in the batch."""
        starts = {c.slot: c.start for c in plan.chunks}
        for i in np.flatnonzero(~plan.busy_b):
            if i in starts:
                p = starts[i]
            elif self.owner[i] is not None:
                p = int(self.fed_b[i])
            else:
                p = 0
            plan.positions_b[i] = -(p + 1)

    def _draft(self, plan: Plan) -> None:
        """Prompt-lookup drafts for the decoding rows (never past a request's max_tokens); any
        at all make the round one VERIFY step."""
        for i in np.flatnonzero(plan.busy_b):
            room = min(self.speculate, self.owner[i].max_tokens - int(self.count_b[i]) - 1)
            d = lookup.draft(self.seq[i], room) if room > 0 else []
            plan.drafts_bk[i, : len(d)], plan.drafted_b[i] = d, len(d)
        if plan.drafted_b.any():
            plan.decode = VERIFY

    def _next_chunk(self, i: int) -> Chunk:
        """Slot i's next prompt chunk (at most `chunk` tokens from where its prompt stands; a
        resumed request's prompt goes on with the tokens it had produced)."""
        start = int(self.fed_b[i])
        n = min(self.chunk, int(self.target_b[i]) - start)
        self.fed_b[i] = start + n
        final = start + n == self.target_b[i]
        if final:
            self.prefilling.remove(i)
        tokens = np.asarray(self.seq[i][start : start + n], np.int32)
        return Chunk(i, start, tokens, self.owner[i].rows, final, index=int(self.count_b[i]))

    def _admit(self, plan: Plan) -> None:
        """New requests into free rows while the round has room and the pool has pages for
        them (keeping one spare page per running request, so that admitting does not preempt
        at once): a plain one takes the pages of its longest cached prefix and new ones for
        its first chunk; a scored one (logprobs) takes the pages of its whole prompt and
        max_tokens and is prefilled whole from position 0, scored."""
        free = [i for i in range(self.slots) if self.owner[i] is None]
        pool = sum(len(c.tokens) for c in plan.chunks)
        while self.queue and free and len(plan.chunks) < self.admit:
            req = self.queue[0]
            scored = req.logprobs is not None
            seq = list(req.prompt) + list(req.resume)
            if pool + (len(seq) if scored else min(self.chunk, len(seq))) > self.shape.pool:
                break  # waits for a round with room for its tokens (a scored one: all)
            if req.cancelled:
                self.queue.popleft()
                req.on_finish("cancelled")
                continue
            counts = self.pool.queried_tokens, self.pool.hit_tokens
            shared = [] if scored else self.pool.lookup(seq, len(seq) - 1)
            reused = len(shared) * self.page
            if scored:
                need = len(req.prompt) + req.max_tokens - 1
            else:
                need = reused + min(self.chunk, len(seq) - reused)
            fresh = -(-need // self.page) - len(shared)
            running = sum(o is not None for o in self.owner)
            if self.pool.available() - running < fresh:  # waits for pages
                self.pool.release(shared)
                self.pool.queried_tokens, self.pool.hit_tokens = counts
                break
            self.queue.popleft()
            i = free.pop(0)
            self._own(i, shared)
            self._own(i, self.pool.allocate(fresh))
            self.owner[i], self.seq[i] = req, seq
            r = req.rows
            self.settings.keys[i], self.settings.temperature[i] = r.keys[0], r.temperature[0]
            self.settings.top_k[i], self.settings.top_p[i] = r.top_k[0], r.top_p[0]
            self.length_b[i], self.count_b[i] = len(req.prompt), len(req.resume)
            self.target_b[i], self.fed_b[i], self.reserved_b[i] = len(seq), reused, scored
            self.admissions += 1
            self.order_b[i] = self.admissions
            if not req.resume:
                req.cached_tokens = reused
            if scored:
                self.fed_b[i] = len(req.prompt)
                plan.chunks.append(Chunk(i, 0, np.asarray(req.prompt, np.int32), r, True, True))
            else:
                self.prefilling.append(i)
                plan.chunks.append(self._next_chunk(i))
            pool += len(plan.chunks[-1].tokens)

    # -- every process: run a round -----------------------------------------------------------

    def _execute(self, plan: Plan) -> bool:
        """Runs one plan on this process's devices, in order: the block table (when it changed),
        the decode part, the chunks; process 0 also hands out the tokens and tells the page
        pool what the rows now hold. False: stop."""
        if not plan.run:
            return False
        if not np.array_equal(plan.table_bm, self.sent):
            table = to_device(plan.table_bm, self.mesh, layout.TABLE_BM)
            self.cache, self.sent = self.cache.with_table(table), plan.table_bm
        if plan.decode == VERIFY:
            self._verify(plan)
        elif plan.decode:
            self._decode(plan)
        if plan.chunks:
            self._prefill(plan.chunks)
        if self.lead:
            self._release()
        return True

    def _decode_args(self, plan: Plan, tokens) -> tuple:
        """The decode part's device arguments: `tokens` (each row's newest, or with its
        drafts), positions, settings, token indices."""
        mesh, rep = self.mesh, P()
        return (
            to_device(tokens, mesh, rep),
            to_device(plan.positions_b, mesh, rep),
            rows_to_device(plan.rows, mesh, rep),
            to_device(plan.count_b, mesh, rep),
        )

    def _verify_args(self, plan: Plan) -> tuple:
        """The verify step's: each row's newest token and its drafts (`_decode_args`)."""
        return self._decode_args(plan, np.concatenate([plan.tokens_b[:, None], plan.drafts_bk], 1))

    def _decode(self, plan: Plan) -> None:
        """The plain or scored decode steps of the round, then their tokens handed out."""
        args = self._decode_args(plan, plan.tokens_b)
        if plan.decode == SCORED:
            scored, self.cache = self.decoder.decode_steps_scored(
                self.cache, *args, self.steps_per_plan
            )
            tokens_kb, *scored = map(to_host, scored)
        else:
            tokens_kb, scored = self._decode_round(*args), None
        self.steps += self.steps_per_plan
        if not self.lead:
            return
        for k, tokens in enumerate(tokens_kb):  # a slot freed at step j ignores the rest
            for i in np.flatnonzero(plan.busy_b):
                if self.owner[i] is not None:
                    self._deliver(
                        i,
                        int(tokens[i]),
                        None if scored is None else tuple(x[k, i] for x in scored),
                    )

    def _verify(self, plan: Plan) -> None:
        """One speculative step: each row's newest token and its drafts; a row takes the drawn
        tokens up to and including the first whose draft was wrong (all of them drawn with the
        keys plain decoding uses, so the tokens are plain decoding's)."""
        drawn_bk, self.cache = self.decoder.verify(self.cache, *self._verify_args(plan))
        drawn_bk = to_host(drawn_bk)
        self.steps += 1
        if not self.lead:
            return
        for i in np.flatnonzero(plan.busy_b):
            n, a = int(plan.drafted_b[i]), 0
            while a < n and plan.drafts_bk[i, a] == drawn_bk[i, a]:
                a += 1
            self.drafted_tokens += n
            self.accepted_tokens += a
            for j in range(a + 1):  # (the rejected drafts' KV lies past what the row holds)
                if self.owner[i] is None:
                    break
                self._deliver(i, int(drawn_bk[i, j]))

    def _prefill(self, chunks: list[Chunk]) -> None:
        """The round's chunks, one program per chunk bucket among them (several chunks of a
        bucket share one, up to PREFILL_TOKENS tokens in all; a power-of-two count of rows, the
        padding rows naming slot `slots`, past the cache: computed, never written); then the
        first tokens of the prompts whose last chunk ran, in the plan's order. Scored prompts
        run whole from position 0 through the scored prefill."""
        groups: dict[tuple[bool, int], list[int]] = {}
        for j, c in enumerate(chunks):
            T = prompt_bucket(len(c.tokens), self.length)
            groups.setdefault((c.scored, T if c.scored else min(T, self.chunk)), []).append(j)
        first: dict[int, tuple] = {}  # chunk -> (first token, its scores or None)
        for (scored, T), group in groups.items():
            for k in range(0, len(group), prefill_rows(T)):
                part = group[k : k + prefill_rows(T)]
                first.update(self._prefill_group([chunks[j] for j in part], part, T, scored))
        if not self.lead:
            return
        for c in chunks:  # the full pages of a prompt are reusable from the next round on
            if self.owner[c.slot] is not None:
                i = c.slot
                self.pool.register(self.held[i], self.seq[i][: c.start + len(c.tokens)])
        for j, c in enumerate(chunks):
            if c.final and self.owner[c.slot] is not None:
                self._deliver(c.slot, *first[j])

    def _prefill_group(self, chunks: list[Chunk], ids: list[int], T: int, scored: bool) -> dict:
        """One program over `chunks` (their tokens padded to T) -> {chunk id: (first token,
        scores or None)}."""
        mesh, rep = self.mesh, P()
        N = prefill_group(len(chunks))
        slots_n, starts_n = np.full(N, self.slots, np.int32), np.zeros(N, np.int32)
        tokens_nt, lengths_n = np.zeros((N, T), np.int32), np.ones(N, np.int32)
        index_n = np.zeros(N, np.int32)
        rows = RowSampling.empty(N)
        for n, c in enumerate(chunks):
            slots_n[n], starts_n[n], lengths_n[n] = c.slot, c.start, len(c.tokens)
            tokens_nt[n, : len(c.tokens)] = c.tokens
            index_n[n] = c.index
            rows.keys[n], rows.temperature[n] = c.rows.keys[0], c.rows.temperature[0]
            rows.top_k[n], rows.top_p[n] = c.rows.top_k[0], c.rows.top_p[0]
        args = [to_device(x, mesh, rep) for x in (slots_n, tokens_nt, starts_n, lengths_n)]
        args.append(rows_to_device(rows, mesh, rep))
        if scored:
            del args[2]  # whole prompts from position 0
            out, self.cache = self.decoder.prefill_slots_scored(self.cache, *args)
            first_n, *scores = map(to_host, out)
        else:
            index = to_device(index_n, mesh, rep)
            first_n, self.cache = self.decoder.extend_slots(self.cache, *args, index)
            first_n, scores = to_host(first_n), None
        out = {}
        for n, (j, c) in enumerate(zip(ids, chunks)):
            out[j] = int(first_n[n]), None
            if scores is not None and self.lead:
                x = (s[n] for s in scores)
                out[j] = int(first_n[n]), self._score_prompt(c.slot, len(c.tokens), *x)
        return out

    def _decode_round(self, tokens_b, positions_b, rows, token_b) -> np.ndarray:
        """One round's decode steps on the device (one program) -> their tokens (k, B) on the
        host; the cache is updated in place."""
        if self.steps_per_plan == 1:
            tokens_b, self.cache = self.decoder.decode_step(
                self.cache, tokens_b, positions_b, rows, token_b
            )
            return to_host(tokens_b)[None]
        tokens_kb, self.cache = self.decoder.decode_steps(
            self.cache, tokens_b, positions_b, rows, token_b, self.steps_per_plan
        )
        return to_host(tokens_kb)

    def _deliver(self, i: int, token: int, scored=None) -> None:
        req = self.owner[i]
        if req.cancelled:
            with self.lock:
                self._free(i, "cancelled")
            return
        if token == NONFINITE:  # broken weights: no token drawn from NaN logits is given
            with self.lock:
                self._free(i, "nonfinite")
            return
        if req.max_tokens == 0:  # scored the prompt only
            with self.lock:
                self._free(i, "length")
            return
        if req.logprobs is not None and scored is not None:
            lp, ids, lps = scored
            n = req.logprobs
            req.scores.append((float(lp), ids[:n].tolist(), lps[:n].tolist()))
        self.count_b[i] += 1
        self.last[i] = token
        if token == req.eos_id and req.eos_id is not None:
            with self.lock:
                self._free(i, "stop")
            return
        self.seq[i].append(token)
        req.on_token(token)
        if self.count_b[i] >= req.max_tokens:
            with self.lock:
                self._free(i, "length")

    def _score_prompt(self, i: int, length: int, lp_t, ids_tk, lps_tk):
        """Sets an echo request's `prompt_scores` (tokens 1..length-1, from positions
        0..length-2) from one row of a scored prefill; returns its first token's scores."""
        req = self.owner[i]
        if req is not None and req.echo and req.logprobs is not None:
            n = req.logprobs
            req.prompt_scores = [
                (float(lp_t[t]), ids_tk[t, :n].tolist(), lps_tk[t, :n].tolist())
                for t in range(length - 1)
            ]
        return lp_t[length - 1], ids_tk[length - 1], lps_tk[length - 1]

    def _free(self, i: int, reason: str) -> None:
        req = self.owner[i]
        self._vacate(i)  # its full pages stay reusable until evicted
        req.on_finish(reason)

    def _release(self) -> None:
        """The pages of the rows vacated since go back to the pool, their full blocks
        registered first (after the round that wrote them)."""
        for pages, tokens in self.released:
            self.pool.register(pages, tokens)
            self.pool.release(pages)
        self.released.clear()

    # -- compile ahead ------------------------------------------------------------------------

    def warmup_programs(self) -> list[tuple[int, int]]:
        """What `warmup` compiles, in order: (rows, tokens) of each chunk program, then
        (slots, 0) for the decode round (with the speculative step when speculating). A
        handful: one row of each shorter chunk bucket
        (up to WARM_PROMPT_TOKENS), then every row group of whole chunks (where long prompts
        spend their prefill); other programs compile on first use (and land in the
        compilation cache)."""
        buckets = {min(prompt_bucket(n, self.length), self.chunk) for n in range(1, self.chunk)}
        group = min(prefill_group(min(self.admit, self.slots)), prefill_rows(self.chunk))
        ones = [(1, T) for T in sorted(buckets - {self.chunk}) if T <= WARM_PROMPT_TOKENS]
        whole = [(1 << k, self.chunk) for k in range(group.bit_length())]
        return ones + whole + [(self.slots, 0)]

    def warmup(self, progress=None) -> None:
        """Compiles `warmup_programs` on every process before serving, running none of them:
        each is lowered with arguments of the kinds serving passes (chunks naming only padding
        rows, the decode round's rows idle) and compiled; jax then reuses it when serving
        calls it. It reads only the cache's shapes, so it may run on another thread while the
        engine serves. `progress(k, n)` is called after the k-th of the n programs has
        compiled."""
        rep, mesh, B = P(), self.mesh, self.slots
        programs = self.warmup_programs()
        cache = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.cache
        )
        for k, (N, T) in enumerate(programs, 1):
            if T:
                zeros = to_device(np.zeros(N, np.int32), mesh, rep)
                self.decoder.lower_extend(
                    cache,
                    to_device(np.full(N, B, np.int32), mesh, rep),
                    to_device(np.zeros((N, T), np.int32), mesh, rep),
                    zeros,
                    to_device(np.ones(N, np.int32), mesh, rep),
                    rows_to_device(RowSampling.empty(N), mesh, rep),
                    zeros,
                ).compile()
            else:
                self._compile_decode(cache)
            if progress is not None:
                progress(k, len(programs))

    def _compile_decode(self, cache) -> None:
        """The decode round's program (and the verify step's when speculating), lowered with
        the arguments `_decode` / `_verify` pass (`_decode_args`, `_verify_args`) for a plan
        that went through its array form, and compiled."""
        B = self.slots
        idle = Plan(
            True,
            DECODE,
            *(np.zeros(B, np.int32),) * 2,
            RowSampling.empty(B),
            np.zeros(B, np.int32),
            np.zeros(B, bool),
            np.zeros((B, self.speculate), np.int32),
            np.zeros(B, np.int32),
            self.table.copy(),
        )
        plan = Plan.from_array(idle.to_array(self.shape), self.shape)
        args = self._decode_args(plan, plan.tokens_b)
        if self.steps_per_plan == 1:
            self.decoder.lower_decode(cache, *args).compile()
        else:
            self.decoder.lower_decode_steps(cache, *args, self.steps_per_plan).compile()
        if self.speculate:
            self.decoder.lower_verify(cache, *self._verify_args(plan)).compile()
