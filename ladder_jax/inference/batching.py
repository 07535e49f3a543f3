"""Continuous batching over the jitted decode step: a fixed number of slots, each owning one row
of one KV cache, filled and emptied between decode steps. Rounds, processes and limits:
docs/inference.md, 'Inside the server'.

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

from ladder_jax.inference.cache import KVCache
from ladder_jax.inference.generation import (
    TOP_LOGPROBS,
    Decoder,
    rows_to_device,
    to_device,
    to_host,
)
from ladder_jax.inference.sampling import NONFINITE, GenerationError, RowSampling, Sampling
from ladder_jax.model import layout
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


def _bits(x) -> np.ndarray:
    """float32 values as the int32 words that carry them in a plan (bit for bit)."""
    return np.ascontiguousarray(x, np.float32).view(np.int32)


def _floats(x) -> np.ndarray:
    return np.ascontiguousarray(x, np.int32).view(np.float32)


@dataclasses.dataclass
class Admission:
    """One prompt a plan prefills: into cache row `slot`, with its sampling settings (one row),
    scored when its request wants logprobs."""

    slot: int
    prompt: np.ndarray  # (n,) int32
    rows: RowSampling
    scored: bool


@dataclasses.dataclass
class Plan:
    """One round of the engine, built on process 0 and run on every process.

        arr = plan.to_array(admit, length); Plan.from_array(arr, slots, length) == plan

    `decode`: 0 no decode round, 1 the plain one, 2 the scored one (some request wants
    logprobs); per slot b its newest token, position, settings, tokens so far (`count_b`) and
    whether it was busy when planned; then the admitted prompts. `to_array` is the int32
    vector processes broadcast (float settings as their bits), of `size(slots, admit,
    length)` words whatever the plan holds: the one place its layout is written."""

    run: bool  # False: stop the loop
    decode: int
    tokens_b: np.ndarray  # (B,) int32
    positions_b: np.ndarray  # (B,) int32
    rows: RowSampling  # (B,)
    count_b: np.ndarray  # (B,) int32
    busy_b: np.ndarray  # (B,) bool
    admissions: list[Admission]

    HEADER = 3  # run, decode, admissions
    SLOT = 9  # a slot's words: token, position, key (2), temperature, top_k, top_p, count, busy
    ADMISSION = 8  # an admission's header: slot, length, key (2), temperature, top_k, top_p,
    # scored; then `length` words of prompt

    @classmethod
    def size(cls, slots: int, admit: int, length: int) -> int:
        return cls.HEADER + cls.SLOT * slots + admit * (cls.ADMISSION + length)

    def to_array(self, admit: int, length: int) -> np.ndarray:
        B = len(self.tokens_b)
        out = np.zeros(self.size(B, admit, length), np.int32)
        out[:3] = [self.run, self.decode, len(self.admissions)]
        r = self.rows
        block = np.stack(
            [
                self.tokens_b,
                self.positions_b,
                r.keys[:, 0].view(np.int32),
                r.keys[:, 1].view(np.int32),
                _bits(r.temperature),
                r.top_k,
                _bits(r.top_p),
                self.count_b,
                self.busy_b.astype(np.int32),
            ],
            1,
        )
        out[3 : 3 + self.SLOT * B] = block.reshape(-1)
        o = 3 + self.SLOT * B
        for a in self.admissions:
            n, r = len(a.prompt), a.rows
            out[o : o + self.ADMISSION] = [
                a.slot,
                n,
                *r.keys[0].view(np.int32),
                _bits(r.temperature)[0],
                r.top_k[0],
                _bits(r.top_p)[0],
                a.scored,
            ]
            out[o + self.ADMISSION : o + self.ADMISSION + n] = a.prompt
            o += self.ADMISSION + length
        return out

    @classmethod
    def from_array(cls, arr: np.ndarray, slots: int, length: int) -> "Plan":
        B = slots
        block = arr[3 : 3 + cls.SLOT * B].reshape(B, cls.SLOT)
        rows = RowSampling(
            np.ascontiguousarray(block[:, 2:4]).view(np.uint32),
            _floats(block[:, 4]),
            block[:, 5].copy(),
            _floats(block[:, 6]),
        )
        admissions, o = [], 3 + cls.SLOT * B
        for _ in range(int(arr[2])):
            h = arr[o : o + cls.ADMISSION]
            n = int(h[1])
            admissions.append(
                Admission(
                    int(h[0]),
                    arr[o + cls.ADMISSION : o + cls.ADMISSION + n].copy(),
                    RowSampling(
                        np.ascontiguousarray(h[2:4]).view(np.uint32)[None],
                        _floats(h[4:5]),
                        h[5:6].copy(),
                        _floats(h[6:7]),
                    ),
                    bool(h[7]),
                )
            )
            o += cls.ADMISSION + length
        return cls(
            bool(arr[0]),
            int(arr[1]),
            block[:, 0].copy(),
            block[:, 1].copy(),
            rows,
            block[:, 7].copy(),
            block[:, 8].astype(bool),
            admissions,
        )


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
        heartbeat_s: float = 1.0,
        consume: bool = False,
    ):
        mesh = model.mesh
        if layout.data_size(mesh) != 1:
            raise GenerationError(
                f"the server batches over slots of one cache: use a mesh "
                f"with data=1 (got data={layout.data_size(mesh)})"
            )
        c = model.config
        self.model, self.mesh, self.config = model, mesh, c
        self.slots, self.max_queue = slots, max_queue
        self.length = min(max_len or c.max_seq_len, c.max_seq_len)
        self.prefills_per_step, self.heartbeat_s = prefills_per_step, heartbeat_s
        if steps_per_plan < 1:
            raise GenerationError(f"steps_per_plan must be >= 1, got {steps_per_plan}")
        self.steps_per_plan = steps_per_plan
        self.admit = prefills_per_step * steps_per_plan  # prefills per plan: same rate per step
        self.decoder = Decoder(model, consume=consume)  # consume: the engine owns model
        self.cache = KVCache.init(c, mesh, slots, self.length)
        self.lead = jax.process_index() == 0
        self.many = jax.process_count() > 1
        # host state of the slots (process 0)
        self.owner: list[Request | None] = [None] * slots
        self.last = np.zeros(slots, np.int32)  # each slot's newest token
        self.length_b = np.zeros(slots, np.int32)  # prompt lengths
        self.count_b = np.zeros(slots, np.int32)  # tokens produced so far
        self.settings = RowSampling.empty(slots)
        self.queue: collections.deque[Request] = collections.deque()
        self.lock = threading.Condition()
        self.admitting, self.stopping = True, False
        self.thread: threading.Thread | None = None
        self.steps = 0  # decode steps run
        self.error: str | None = None  # why the loop died, if it did

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
                plan = self._plan().to_array(self.admit, self.length)
            if self.many:
                multihost_utils.broadcast_one_to_all(plan)
            if not self._execute(Plan.from_array(plan, self.slots, self.length)):
                return

    def follow(self) -> None:
        """Processes other than 0: run process 0's plans until it stops."""
        zeros = np.zeros(Plan.size(self.slots, self.admit, self.length), np.int32)
        while self._execute(
            Plan.from_array(
                np.asarray(multihost_utils.broadcast_one_to_all(zeros)), self.slots, self.length
            )
        ):
            pass

    def _plan(self) -> Plan:
        """The next iteration (module docstring); frees cancelled slots and pops admitted
        requests from the queue (called with the lock held)."""
        for i, req in enumerate(self.owner):
            if req is not None and req.cancelled:
                self._free(i, "cancelled")
        busy_b = np.array([o is not None for o in self.owner])
        decode = int(busy_b.any()) and not self.stopping
        if decode and any(o is not None and o.logprobs is not None for o in self.owner):
            decode = 2  # the scored decode round
        s = self.settings
        plan = Plan(
            not self.stopping,
            decode,
            self.last.copy(),
            np.where(busy_b, self.length_b + self.count_b - 1, 0).astype(np.int32),
            RowSampling(s.keys.copy(), s.temperature.copy(), s.top_k.copy(), s.top_p.copy()),
            self.count_b.copy(),
            busy_b,
            [],
        )
        free = [i for i in range(self.slots) if self.owner[i] is None]
        while self.queue and free and len(plan.admissions) < self.admit and not self.stopping:
            req = self.queue.popleft()
            if req.cancelled:
                req.on_finish("cancelled")
                continue
            i = free.pop(0)
            self.owner[i] = req
            r = req.rows
            self.settings.keys[i], self.settings.temperature[i] = r.keys[0], r.temperature[0]
            self.settings.top_k[i], self.settings.top_p[i] = r.top_k[0], r.top_p[0]
            self.length_b[i], self.count_b[i] = len(req.prompt), 0
            plan.admissions.append(
                Admission(i, np.asarray(req.prompt, np.int32), r, req.logprobs is not None)
            )
        return plan

    def _execute(self, plan: Plan) -> bool:
        """Runs one plan on this process's devices; process 0 also hands out the tokens.
        False: stop."""
        if not plan.run:
            return False
        B, mesh, rep = self.slots, self.mesh, P()
        if plan.decode:
            args = (
                to_device(plan.tokens_b, mesh, rep),
                to_device(plan.positions_b, mesh, rep),
                rows_to_device(plan.rows, mesh, rep),
                to_device(plan.count_b, mesh, rep),
            )
            if plan.decode == 2:
                scored, self.cache = self.decoder.decode_steps_scored(
                    self.cache, *args, self.steps_per_plan
                )
                tokens_kb, *scored = map(to_host, scored)
            else:
                tokens_kb, scored = self._decode_round(*args), None
            self.steps += self.steps_per_plan
            if self.lead:
                for k, tokens in enumerate(tokens_kb):  # a slot freed at step j ignores the
                    for i in range(B):  # rest of its tokens
                        if plan.busy_b[i] and self.owner[i] is not None:  # busy when planned
                            self._deliver(
                                i,
                                int(tokens[i]),
                                None if scored is None else tuple(x[k, i] for x in scored),
                            )
        if plan.admissions:
            self._prefill(plan.admissions)
        return True

    def _prefill(self, admissions: list[Admission]) -> None:
        """The admitted prompts into their slots, one program per prompt bucket among them
        (several prompts of a bucket share one, up to PREFILL_TOKENS tokens in all; a
        power-of-two count of rows, the padding rows
        naming slot `slots`, past the cache: computed, never written), then their first tokens
        handed out, in the plan's order."""
        B, mesh, rep = self.slots, self.mesh, P()
        groups: dict[int, list[int]] = {}
        for j, a in enumerate(admissions):
            groups.setdefault(prompt_bucket(len(a.prompt), self.length), []).append(j)
        first: dict[int, tuple] = {}  # admission -> (first token, its scores or None)
        chunks = [
            (T, group[i : i + prefill_rows(T)])
            for T, group in groups.items()
            for i in range(0, len(group), prefill_rows(T))
        ]
        for T, group in chunks:
            N = prefill_group(len(group))
            slots_n = np.full(N, B, np.int32)
            tokens_nt, lengths_n = np.zeros((N, T), np.int32), np.ones(N, np.int32)
            rows = RowSampling.empty(N)
            for n, j in enumerate(group):
                a = admissions[j]
                slots_n[n], lengths_n[n] = a.slot, len(a.prompt)
                tokens_nt[n, : len(a.prompt)] = a.prompt
                rows.keys[n], rows.temperature[n] = a.rows.keys[0], a.rows.temperature[0]
                rows.top_k[n], rows.top_p[n] = a.rows.top_k[0], a.rows.top_p[0]
            args = (
                self.cache,
                to_device(slots_n, mesh, rep),
                to_device(tokens_nt, mesh, rep),
                to_device(lengths_n, mesh, rep),
                rows_to_device(rows, mesh, rep),
            )
            if any(admissions[j].scored for j in group):  # some request wants logprobs
                scored, self.cache = self.decoder.prefill_slots_scored(*args)
                first_n, *scored = map(to_host, scored)
            else:
                first_n, self.cache = self.decoder.prefill_slots(*args)
                first_n, scored = to_host(first_n), None
            for n, j in enumerate(group):
                first[j] = int(first_n[n]), None
                if scored is not None and self.lead:
                    a = admissions[j]
                    first[j] = (
                        int(first_n[n]),
                        self._score_prompt(a.slot, len(a.prompt), *(x[n] for x in scored)),
                    )
        if self.lead:
            for j, a in enumerate(admissions):
                self._deliver(a.slot, *first[j])

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
        req, self.owner[i] = self.owner[i], None
        self.settings.temperature[i], self.settings.top_k[i] = 0, 0
        self.count_b[i], self.last[i], self.length_b[i] = 0, 0, 0
        req.on_finish(reason)

    # -- compile ahead ------------------------------------------------------------------------

    def warmup_programs(self) -> list[tuple[int, int]]:
        """What `warmup` compiles, in order: (rows, prompt tokens) of each prefill program, then
        (slots, 0) for the decode round. A handful: one prompt of each bucket up to
        WARM_PROMPT_TOKENS, a full admission group of the shortest bucket; other prefill
        programs compile on first use (and land in the compilation cache)."""
        buckets = sorted({prompt_bucket(n, self.length) for n in range(1, self.length + 1)})
        group = min(prefill_group(min(self.admit, self.slots)), prefill_rows(buckets[0]))
        ones = [(1, T) for T in buckets if T <= WARM_PROMPT_TOKENS] or [(1, buckets[0])]
        return ones + ([(group, buckets[0])] if group > 1 else []) + [(self.slots, 0)]

    def warmup(self, progress=None) -> None:
        """Compiles the decode round and every prefill program (each prompt bucket x each
        admission group size, `warmup_programs`), on every process, before serving: prefills
        run on padding rows only (nothing is written), the decode round on free slots.
        `progress(k, n)` is called after the k-th of the n programs has compiled."""
        rep, mesh = P(), self.mesh
        programs = self.warmup_programs()
        for k, (N, T) in enumerate(programs, 1):
            if T:
                rows = rows_to_device(RowSampling.empty(N), mesh, rep)
                first, self.cache = self.decoder.prefill_slots(
                    self.cache,
                    to_device(np.full(N, self.slots, np.int32), mesh, rep),
                    to_device(np.zeros((N, T), np.int32), mesh, rep),
                    to_device(np.ones(N, np.int32), mesh, rep),
                    rows,
                )
                to_host(first)
            else:
                z = to_device(np.zeros(self.slots, np.int32), mesh, rep)
                self._decode_round(
                    z, z, rows_to_device(RowSampling.empty(self.slots), mesh, rep), z
                )
            if progress is not None:
                progress(k, len(programs))
