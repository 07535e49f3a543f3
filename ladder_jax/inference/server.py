"""The OpenAI-compatible HTTP API over the continuous-batching engine (Starlette on uvicorn, the
`serve` extra): one handler per endpoint, over `openai_schema`, `request_checks`, `answers` and
`metrics`. docs/inference.md, 'Serve'; logprobs: docs/logprobs.md.

    app = create_app(engine, tokenizer, model_name="tiny", api_key="secret")"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import secrets
import time

import h11
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from ladder_jax.inference.answers import Answers, Run, Scores, usage
from ladder_jax.inference.batching import Engine
from ladder_jax.inference.metrics import Metrics
from ladder_jax.inference.openai_schema import (
    UNAUTHORIZED,
    BadRequest,
    Logprobs,
    error,
    is_batch,
    parse_json,
    scored,
    scoring,
)
from ladder_jax.inference.request_checks import RequestChecks

_log = logging.getLogger("ladder_jax.serve")


class App:
    """The HTTP API of one started `Engine`: state (draining), authentication, one handler per
    endpoint; request checks in `checks`, the answering paths in `answers`.

        app = App(engine, tokenizer, model_name="tiny").starlette()"""

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        *,
        model_name: str,
        api_key: str | None = None,
        max_request_bytes: int = 1 << 20,
        max_tokens_limit: int | None = None,
        chat_template: str | None = None,
    ):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.api_key, self.max_request_bytes = api_key, max_request_bytes
        self.checks = RequestChecks(
            engine,
            tokenizer,
            model_name=model_name,
            max_tokens_limit=max_tokens_limit,
            chat_template=chat_template,
        )
        self.metrics = Metrics(engine)
        self.answers = Answers(engine, self.metrics, model_name)
        self.draining = False
        self.created = int(time.time())

    def starlette(self) -> Starlette:
        app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self.http_error},
        )
        app.state.drain = self.drain
        app.state.metrics = self.metrics
        return app

    def drain(self) -> None:
        """New requests get 503 from now on."""
        self.draining = True

    # -- the endpoints ----------------------------------------------------------------------

    async def completions(self, request: HTTPRequest) -> Response:
        return await self.answered(request, chat=False)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self.answered(request, chat=True)

    async def models(self, request: HTTPRequest) -> Response:
        if not self.authorized(request):
            return error(401, UNAUTHORIZED, code="invalid_api_key")
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "ladder_jax",
                    }
                ],
            }
        )

    async def health(self, request: HTTPRequest) -> Response:
        engine = self.engine
        status = "failed" if engine.error else "draining" if self.draining else "ok"
        return JSONResponse(
            {
                "status": status,
                "slots": engine.slots,
                "busy": engine.busy,
                "waiting": engine.waiting,
            },
            status_code=200 if status == "ok" else 503,
        )

    async def prometheus(self, request: HTTPRequest) -> Response:
        if not self.authorized(request):
            return error(401, UNAUTHORIZED, code="invalid_api_key")
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(self, request: HTTPRequest, exc: HTTPException) -> Response:
        message = {
            404: f"no route {request.url.path}: see /v1/models, /v1/completions, "
            f"/v1/chat/completions, /health, /metrics",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return error(exc.status_code, message)

    # -- admission and request checks -------------------------------------------------------

    def authorized(self, request: HTTPRequest) -> bool:
        if self.api_key is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("utf-8", "replace"), self.api_key.encode()
        )

    def admit(self, request: HTTPRequest) -> None:
        """BadRequest unless the request may be answered: its key (401), the server's state
        (503)."""
        if not self.authorized(request):
            raise BadRequest(UNAUTHORIZED, status=401, code="invalid_api_key")
        if self.draining or self.engine.error:
            raise BadRequest(
                "the server is shutting down"
                if self.draining
                else f"the engine failed: {self.engine.error}",
                status=503,
            )

    async def read_json(self, request: HTTPRequest) -> dict:
        limit = self.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(
                f"the request body has {declared} bytes, more than the server's limit of {limit}",
                status=413,
            )
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise BadRequest(
                        f"the request body is more than the server's limit of {limit} bytes",
                        status=413,
                    )
        except ClientDisconnect:
            raise BadRequest(
                "the client went away before sending the whole body", status=499
            ) from None
        return parse_json(body)

    async def answered(self, request: HTTPRequest, chat: bool) -> Response:
        """`generate`, with anything it did not foresee one counted 500 and one log line."""
        try:
            return await self.generate(request, chat)
        except Exception as e:  # noqa: BLE001 (the server must stay up and say what failed)
            self.metrics.request("chat" if chat else "completions", 500)
            _log.error("%s %s: %s: %s", request.method, request.url.path, type(e).__name__, e)
            return error(500, f"the server failed on this request ({type(e).__name__})")

    async def generate(self, request: HTTPRequest, chat: bool) -> Response:
        """One completion or chat answer, whole or streamed; scoring requests go to
        `scored_completions`."""
        endpoint = "chat" if chat else "completions"
        try:
            self.admit(request)
            data = await self.read_json(request)
            if not chat and scored(data):
                return await self.scored_completions(request, data)
            parsed = await asyncio.to_thread(self.checks.parse, data, chat)
        except BadRequest as e:
            return self.answers.refused(endpoint, e)
        run = Run(self.tokenizer, parsed)
        refused = self.answers.submit([run], endpoint)
        if refused is not None:
            return refused
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        if parsed.stream:
            chunk = self.answers.plain_chunk(rid, chat)
            return self.answers.streamed(
                run,
                endpoint,
                chunk,
                parsed.usage,
                head=chunk("", None, role=True) if chat else None,
            )
        outs = await self.answers.collect(request, [run], endpoint)
        if isinstance(outs, Response):
            return outs
        ((out, reason),) = outs
        self.metrics.request(endpoint, 200)
        choice = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": out},
                "logprobs": None,
                "finish_reason": reason,
            }
            if chat
            else {"index": 0, "text": out, "logprobs": None, "finish_reason": reason}
        )
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [choice],
                "usage": usage([run]),
            }
        )

    # -- /v1/completions with logprobs, echo or a batch of prompts -------------------------

    async def scored_completions(self, request: HTTPRequest, data: dict) -> Response:
        """Every prompt checked (as `parse` does one) before any is submitted; then one engine
        request per prompt, a choice each (index = the prompt's place), with OpenAI's legacy
        `logprobs` object if asked. Streamed: one prompt only."""
        top, echo = scoring(data)
        raw = data.get("prompt")
        prompts = raw if is_batch(raw) else [raw]
        parsed = await asyncio.to_thread(self.checks.parse_each, data, prompts)
        if parsed[0].stream and len(prompts) > 1:
            raise BadRequest(f"stream=true takes one prompt, got {len(prompts)}", "stream")
        runs = [Run(self.tokenizer, p, logprobs=top, echo=echo) for p in parsed]
        refused = self.answers.submit(runs, "completions")
        if refused is not None:
            return refused
        decode = self.tokenizer.decode
        echoed = [
            (p if isinstance(p, str) else await asyncio.to_thread(decode, r.req.prompt))
            if echo
            else ""
            for p, r in zip(prompts, runs)
        ]
        scores = Scores(Logprobs(self.tokenizer), top, echo)
        rid = "cmpl-" + secrets.token_hex(12)
        if parsed[0].stream:
            return self.answers.scored_stream(runs[0], echoed[0], scores, rid, parsed[0].usage)
        outs = await self.answers.collect(request, runs, "completions")
        if isinstance(outs, Response):
            return outs

        def answer() -> JSONResponse:  # linear in the tokens, but off the event loop
            choices = [
                {
                    "index": i,
                    "text": pre + out,
                    "logprobs": scores.whole(run, len(pre)),
                    "finish_reason": reason,
                }
                for i, (run, (out, reason), pre) in enumerate(zip(runs, outs, echoed))
            ]
            body = {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": usage(runs),
            }
            return JSONResponse(body)

        response = await asyncio.to_thread(answer)
        self.metrics.request("completions", 200)
        return response


def create_app(
    engine: Engine,
    tokenizer,
    *,
    model_name: str,
    api_key: str | None = None,
    max_request_bytes: int = 1 << 20,
    max_tokens_limit: int | None = None,
    chat_template: str | None = None,
) -> Starlette:
    """The ASGI app serving `engine` (already started) with `tokenizer` (`App`)."""
    return App(
        engine,
        tokenizer,
        model_name=model_name,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        max_tokens_limit=max_tokens_limit,
        chat_template=chat_template,
    ).starlette()


def deadline_protocol(seconds: float, max_connections: int | None = None):
    """uvicorn's h11 protocol class with a deadline: a connection must deliver one whole
    request (head and body) within `seconds` of opening or of its previous response, else it
    is closed (a body cut short reaches the app as a disconnect). uvicorn has no such timeout of
    its own (its keep-alive timeout starts only after a response), so partial requests held
    open would pin file descriptors. `max_connections` bounds the open connections below the
    process's file descriptors: one more closes the oldest still sending its request (or,
    when none is, the new one), so clients holding half-sent requests never lock others out.
    Use: `uvicorn.Config(app, http=deadline_protocol(30, 900))`."""
    opened: set = set()
    sending: collections.OrderedDict = collections.OrderedDict()  # oldest first

    class DeadlineH11Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            opened.add(self)
            self._arm()
            if max_connections is not None and len(opened) > max_connections:
                oldest = next(iter(sending))  # self at least
                oldest._disarm()
                oldest.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self.conn.their_state is not (
                h11.SEND_BODY
            ):
                self._disarm()  # the whole request is in: the response may take its time

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            opened.discard(self)
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired)
            sending[self] = None

        def _disarm(self) -> None:
            sending.pop(self, None)
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.close()

    return DeadlineH11Protocol
