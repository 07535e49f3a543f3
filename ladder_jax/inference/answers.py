"""How the server answers a checked request: `Run` (one engine request, its tokens posted to the
event loop and read back as text) and `Answers` (submit, collect or stream server-sent events,
count each request once). docs/inference.md, 'Inside the server'.

    refused = answers.submit([run], "completions") or await answers.collect(request, [run], ...)"""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse

from ladder_jax.inference.batching import Engine, EngineFull, Request
from ladder_jax.inference.detokenize import Detokenizer
from ladder_jax.inference.metrics import Metrics
from ladder_jax.inference.openai_schema import (
    NONFINITE_EVENT,
    NONFINITE_MESSAGE,
    BadRequest,
    Logprobs,
    Parsed,
    error,
    event,
)
from ladder_jax.inference.sampling import GenerationError


class TextStream:
    """Token ids in, text pieces out: holds back a possible stop string's start and a cut
    multi-byte character; `stopped` once a stop string appears (the text ends before it)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = Detokenizer(tokenizer)
        self.tokens = self.text.ids
        self.sent = 0
        self.stopped = False

    def add(self, token: int) -> str:
        """The piece that can be sent now; a stop string cuts the text at the earliest
        one found (the text before `sent` never holds one: it was searched then)."""
        self.text.add(token)
        rest = self.text.from_char(self.sent)
        hits = [at for stop in self.stops if (at := rest.find(stop)) >= 0]
        if hits:
            at = min(hits)
            self.sent, self.stopped = self.sent + at, True
            return rest[:at]
        safe = len(rest) - self.hold
        while safe > 0 and rest[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= 0:
            return ""
        self.sent += safe
        return rest[:safe]

    def flush(self) -> str:
        if self.stopped:
            return ""
        piece = self.text.from_char(self.sent)
        self.sent += len(piece)
        return piece


class Run:
    """One engine request of an HTTP request: the engine's callbacks (on its own thread) post
    its tokens to the event loop's queue, read back as text pieces through a `TextStream`.

        run = Run(tokenizer, parsed); engine.submit(run.req)"""

    def __init__(self, tokenizer, parsed: Parsed, logprobs: int | None = None, echo: bool = False):
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()

        def put(item):
            try:
                loop.call_soon_threadsafe(self.events.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening
                pass

        self.req = Request(
            prompt=parsed.prompt,
            max_tokens=parsed.max_tokens,
            sampling=parsed.sampling,
            eos_id=tokenizer.eos_id,
            on_token=lambda t: put(("token", t)),
            on_finish=lambda r: put(("finish", r)),
            logprobs=logprobs,
            echo=echo,
        )
        self.text = TextStream(tokenizer, parsed.stops)


def usage(runs: list[Run]) -> dict:
    """OpenAI's `usage` of the runs of one response; `prompt_tokens_details.cached_tokens`: the
    prompt tokens whose KV the engine reused from its prefix cache (0 when it has none)."""
    p = sum(len(r.req.prompt) for r in runs)
    n = sum(len(r.text.tokens) for r in runs)
    cached = sum(getattr(r.req, "cached_tokens", 0) for r in runs)
    return {
        "prompt_tokens": p,
        "completion_tokens": n,
        "total_tokens": p + n,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def disconnected(request: HTTPRequest) -> None:
    """Returns once the client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _settled(future: asyncio.Future) -> None:
    """Reads a cancelled future's outcome, so asyncio logs no "exception was never
    retrieved" traceback for it."""
    if not future.cancelled():
        future.exception()


class Answers:
    """The answering paths of one engine: submit runs, wait for them whole (`collect`) or
    stream them (`streamed`), counting each request once in `metrics`."""

    def __init__(self, engine: Engine, metrics: Metrics, model_name: str):
        self.engine, self.metrics, self.model_name = engine, metrics, model_name

    def refused(self, endpoint: str, e: BadRequest) -> Response:
        self.metrics.request(endpoint, e.status)
        if e.status == 499:
            return Response(status_code=499)
        return error(e.status, str(e), e.param, e.code)

    def submit(self, runs: list[Run], endpoint: str) -> Response | None:
        """Submits every run, or none (the counted 503 of a queue full now, 400 of a prompt
        the engine refuses or of a batch the queue can never hold)."""
        try:
            self.engine.submit_all([run.req for run in runs])
        except GenerationError as e:
            full = isinstance(e, EngineFull)
            self.metrics.request(endpoint, 503 if full else 400)
            return error(503, str(e)) if full else error(400, str(e), "prompt")
        self.metrics.prompt_tokens.inc(sum(len(run.req.prompt) for run in runs))
        return None

    async def steps(self, run: Run):
        """(text piece, finish reason or None) per engine event until the run ends; a stop
        string ends it early (reason "stop")."""
        first = True
        while True:
            kind, value = await run.events.get()
            if kind != "token":
                yield run.text.flush(), value
                return
            if first:
                self.metrics.ttft.observe(time.perf_counter() - run.req.arrived)
                first = False
            self.metrics.generated_tokens.inc()
            piece = run.text.add(value)
            if run.text.stopped:
                self.engine.cancel(run.req)
                yield piece, "stop"
                return
            yield piece, None

    async def whole(self, run: Run) -> tuple[str, str]:
        """The run's whole text and finish reason."""
        out, reason = [], None
        async for piece, reason in self.steps(run):
            out.append(piece)
        return "".join(out), reason

    async def collect(
        self, request: HTTPRequest, runs: list[Run], endpoint: str
    ) -> list[tuple[str, str]] | Response:
        """Each run's (text, finish reason) once all are done; or the counted response when
        the client went away (499), the logits were not finite (500) or the engine stopped
        (503)."""
        watcher = asyncio.ensure_future(disconnected(request))
        result = asyncio.ensure_future(asyncio.gather(*map(self.whole, runs)))
        try:
            await asyncio.wait({watcher, result}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not result.done():  # the client went away
            result.add_done_callback(_settled)
            result.cancel()
            return self.cancelled(runs, endpoint, 499, Response(status_code=499))
        outs = result.result()
        reasons = [reason for _, reason in outs]
        if "nonfinite" in reasons:
            return self.cancelled(runs, endpoint, 500, error(500, NONFINITE_MESSAGE))
        stopped = next((r for r in reasons if r in ("cancelled", "error")), None)
        if stopped is not None:
            return self.cancelled(
                runs,
                endpoint,
                503,
                error(
                    503,
                    "the server is shutting down"
                    if stopped == "cancelled"
                    else f"the engine failed: {self.engine.error}",
                ),
            )
        return outs

    def cancelled(
        self, runs: list[Run], endpoint: str, status: int, response: Response
    ) -> Response:
        for run in runs:
            self.engine.cancel(run.req)
        self.metrics.request(endpoint, status)
        return response

    def streamed(
        self, run: Run, endpoint: str, chunk, include_usage: bool, *, head=None, opening=None
    ) -> StreamingResponse:
        """The server-sent events of one run (`stream`) as a response."""
        events = self.stream(run, endpoint, chunk, include_usage, head, opening)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def stream(self, run: Run, endpoint: str, chunk, include_usage: bool, head, opening):
        """`head` (an event, or None) first, `opening()` (None or an event) with the first
        engine event, then `chunk(piece, reason)` per text piece, the usage and [DONE]; NaN
        logits: an error event ends the stream (counted 500). Counted 200 when whole, 499
        when the client went away (the generator is closed); the run is cancelled either
        way."""
        done = False
        try:
            if head is not None:
                yield head
            first = True
            async for piece, reason in self.steps(run):
                if first and opening is not None and (opened := await asyncio.to_thread(opening)):
                    yield opened
                first = False
                if reason == "nonfinite":  # OpenAI's way to fail mid-stream: an error event
                    yield NONFINITE_EVENT
                    self.metrics.request(endpoint, 500)
                    done = True
                    return
                if reason in ("cancelled", "error"):
                    reason = "abort"  # as vLLM says it: drained or failed mid-stream
                if piece or reason:
                    yield chunk(piece, reason)
            if include_usage:
                yield chunk(None, None, usage=usage([run]))
            yield "data: [DONE]\n\n"
            done = True
            self.metrics.request(endpoint, 200)
        finally:  # also when the client disconnects (the generator is closed)
            self.engine.cancel(run.req)
            if not done:
                self.metrics.request(endpoint, 499)  # a dropped stream

    def chunk_event(self, rid: str, kind: str, choice: dict | None, counts=None) -> str:
        """One chunk of a streamed answer: a choice, or (choice None) the final usage."""
        obj = {
            "id": rid,
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [] if choice is None else [choice],
        }
        return event(obj if counts is None else {**obj, "usage": counts})

    def plain_chunk(self, rid: str, chat: bool):
        """chunk(piece, reason) of a plain completion or a chat answer (`role`: chat's first
        chunk, `usage`: the final one)."""
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece, reason, role=False, usage=None):
            if usage is not None:
                return self.chunk_event(rid, kind, None, usage)
            if chat:
                delta = (
                    {"role": "assistant", "content": ""}
                    if role
                    else ({"content": piece} if piece else {})
                )
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}
            return self.chunk_event(rid, kind, choice)

        return chunk

    def scored_stream(
        self, run: Run, echoed: str, scores: Scores, rid: str, include_usage: bool
    ) -> StreamingResponse:
        """The events of one scored prompt: the echoed prompt first (with its logprobs), then
        each text piece with the logprobs of the tokens read since the last chunk."""
        sent = 0

        def chunk(piece, reason, usage=None):
            nonlocal sent
            if usage is not None:
                return self.chunk_event(rid, "text_completion", None, usage)
            lp = scores.new(run, len(echoed), sent)
            sent = len(run.text.tokens)
            return self.chunk_event(
                rid,
                "text_completion",
                {"index": 0, "text": piece, "logprobs": lp, "finish_reason": reason},
            )

        def opening():
            if not echoed:
                return None
            return self.chunk_event(
                rid,
                "text_completion",
                {"index": 0, "text": echoed, "logprobs": scores.prompt(run), "finish_reason": None},
            )

        return self.streamed(run, "completions", chunk, include_usage, opening=opening)


class Scores:
    """The `logprobs` objects of a scored run: None unless asked (`top` alternatives per
    token); with echo, the prompt's come first."""

    def __init__(self, logprobs: Logprobs, top: int | None, echo: bool):
        self.logprobs, self.top, self.echo = logprobs, top, echo

    def prompt(self, run: Run) -> dict | None:
        """The prompt's tokens' object (the first is null: nothing predicts it); None when
        not asked, or when the run was cancelled before its prefill."""
        req = run.req
        if self.top is None or not self.echo or req.prompt_scores is None:
            return None
        text = Detokenizer(self.logprobs.tokenizer)
        text.extend(req.prompt)
        return self.logprobs.of(req.prompt, [None, *req.prompt_scores], text.starts, 0)

    def new(self, run: Run, base: int, start: int) -> dict | None:
        """The generated tokens' object from token `start` on, offsets from `base`."""
        if self.top is None:
            return None
        return self.logprobs.of(run.text.tokens, run.req.scores, run.text.text.starts, base, start)

    def whole(self, run: Run, base: int) -> dict | None:
        """The whole answer's object: the prompt's (with echo), then the generated tokens'."""
        lp = self.new(run, base, 0)
        if lp is not None and self.echo:
            lp = Logprobs.join(self.prompt(run), lp)
        return lp
