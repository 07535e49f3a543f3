"""The OpenAI-compatible HTTP API over the continuous-batching engine (Starlette on uvicorn,
from `python -m ladder_jax.serve`; the `serve` extra).

    app = create_app(engine, tokenizer, model_name="tiny", api_key="secret")

`App` holds the state and has one handler per endpoint: /v1/completions,
/v1/chat/completions (with a chat template), /v1/models, /health, /metrics. Each request is
counted once in /metrics by endpoint and status (499: the client went away, a dropped stream
too). Every error is OpenAI's `{"error": {message, type, param, code}}` with its status,
naming the field; one bad request never stops the server (NaN logits from broken weights: a
500; streamed, an error event ends the stream). The engine calls back on its own thread:
tokens reach a request only through `loop.call_soon_threadsafe`. A disconnect cancels its
request. Streamed pieces hold back a possible stop string or a cut character, so they add
up to the final text. Starlette, not FastAPI: errors keep OpenAI's shape (fields with fixed
limits are declared in pydantic, `_Sampling` / `_Scoring`). See docs/inference.md;
logprobs, echo and max_tokens=0 on /v1/completions: docs/logprobs.md (the log-softmax of the
raw logits, before temperature, top_k and top_p).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import secrets
import time
from typing import Annotated, Any, Literal, NamedTuple

import jinja2.sandbox
import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ladder_jax.inference.batching import Engine, EngineFull, Request
from ladder_jax.inference.generation import TOP_LOGPROBS
from ladder_jax.inference.sampling import GenerationError, Sampling, is_int

NONFINITE_MESSAGE = (
    "the model's logits are NaN or infinite: its weights are broken (a "
    "checkpoint of a run that diverged?); no tokens are drawn from them"
)
UNAUTHORIZED = "missing or wrong API key: send Authorization: Bearer KEY"
_log = logging.getLogger("ladder_jax.serve")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# fields accepted as OpenAI sends them; the `only` ones must keep their neutral value
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "user",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
}
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
_NEUTRAL = {
    "n": (1,),
    "logprobs": (None, False, 0),
    "echo": (False,),
    "best_of": (1,),
    "suffix": (None, ""),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": (None, {}),
    "top_logprobs": (None, 0),
}
_NEUTRAL_COMPLETION = {k: v for k, v in _NEUTRAL.items() if k not in ("logprobs", "echo")}


class BadRequest(Exception):
    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error(status: int, message: str, param=None, code=None) -> JSONResponse:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        503: "server_overloaded",
    }.get(status, "server_error")
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status_code=status,
    )


class _Checked(BaseModel):
    """Declared types and ranges of body fields whose limits are fixed (pydantic, strict: no
    "1" for 1, no true for 1). `checked` raises the BadRequest of the first wrong field in
    declaration order, with its message from `_SAYS`."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @classmethod
    def checked(cls, data: dict, **limits):
        try:
            return cls.model_validate(data, context=limits)
        except ValidationError as e:
            field = e.errors()[0]["loc"][0]
            raise BadRequest(_SAYS[field].format(data.get(field), **limits), field) from None


_Stop = Annotated[str, Field(min_length=1)]


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Any = None


class _Sampling(_Checked):
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1, 0: off (vLLM's spellings)
    seed: Annotated[int, Field(ge=0, lt=2**32)] | None = None
    stop: _Stop | Annotated[list[_Stop], Field(max_length=4)] | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None

    @field_validator("top_k")
    @classmethod
    def _in_vocab(cls, top_k, info):
        if top_k is not None and top_k > info.context["vocab"]:
            raise ValueError("past the vocabulary")
        return None if top_k in (-1, 0) else top_k


class _Scoring(_Checked):
    logprobs: Annotated[int, Field(ge=0, le=TOP_LOGPROBS)] | Literal[False] | None = None
    echo: bool | None = None


_SAYS = {
    "temperature": "temperature={!r} must be a number from 0 to 2",
    "top_p": "top_p={!r} must be in (0, 1]",
    "top_k": "top_k={!r} must be an integer from 1 to {vocab} (or -1: off)",
    "seed": "seed={!r} must be an integer from 0 to 2**32 - 1",
    "stop": "stop must be a non-empty string or a list of up to 4 of them",
    "stream": "stream={!r} must be true or false",
    "stream_options": "stream_options may only hold include_usage",
    "logprobs": f"logprobs={{!r}} must be an integer from 0 to {TOP_LOGPROBS} (or null)",
    "echo": "echo={!r} must be true or false",
}


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (two apps in one process keep
    their counts apart); the engine's own counts are read when /metrics is scraped. No
    `*_created` series: prometheus_client's switch for them is process-wide, and building
    Metrics turns it off.

        metrics = Metrics(engine); metrics.request("chat", 200); body = metrics.text()"""

    def __init__(self, engine: Engine):
        prom.disable_created_metrics()  # read at each scrape, so it holds for this registry
        self.registry = r = prom.CollectorRegistry()
        self.requests = prom.Counter(
            "ladder_requests",
            "Requests answered, by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = prom.Counter(
            "ladder_prompt_tokens", "Prompt tokens admitted.", registry=r
        )
        self.generated_tokens = prom.Counter(
            "ladder_generation_tokens", "Tokens generated.", registry=r
        )
        self.ttft = prom.Histogram(
            "ladder_time_to_first_token_seconds",
            "From arrival to the first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        r.register(_EngineCounts(engine))

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def text(self) -> bytes:
        return prom.generate_latest(self.registry)


class _EngineCounts(prom.registry.Collector):
    """The engine's decode steps, queue and slots, as they are at each scrape."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        yield CounterMetricFamily("ladder_decode_steps", "Batched decode steps run.", e.steps)
        for name, help_, value in (
            ("queue_depth", "Requests waiting for a slot.", e.waiting),
            ("slots_busy", "Slots generating.", e.busy),
            ("slots_total", "Slots (rows of the KV cache).", e.slots),
        ):
            yield GaugeMetricFamily(f"ladder_{name}", help_, value)


class TextStream:
    """Token ids in, text pieces out: holds back a possible stop string's start and a cut
    multi-byte character; `stopped` once a stop string appears (the text ends before it)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.sent = 0
        self.stopped = False

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                piece, self.sent, self.stopped = text[self.sent : at], max(self.sent, at), True
                return piece
        safe = len(text) - self.hold
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.sent:
            return ""
        piece, self.sent = text[self.sent : safe], safe
        return piece

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.tokens)
        piece, self.sent = text[self.sent :], len(text)
        return piece


def render_chat(template, messages: list[dict], tokenizer) -> list[int]:
    """The prompt ids of `messages` through a compiled chat template. The template sees the
    tokenizer's BOS / EOS strings (`bos_token`, `eos_token`, as in transformers'
    `apply_chat_template`; empty for the byte tokenizer, which has no text for them). The text
    gets the tokenizer's own BOS convention (`add_bos`; none for SmolLM2's), except that a text
    that starts with the BOS string gets no second BOS."""
    bos, eos = (tokenizer.special_text(i) for i in (tokenizer.bos_id, tokenizer.eos_id))
    text = template.render(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
    )
    return tokenizer.encode(text, bos=False if bos and text.startswith(bos) else None)


class TemplateRaised(jinja2.TemplateError):
    """A chat template's own `raise_exception(message)`: the message is for the client."""


def _raise_exception(message):
    raise TemplateRaised(str(message))


def compile_chat_template(source: str):
    """A chat template compiled as transformers does (sandboxed, trim/lstrip blocks,
    `raise_exception` defined); jinja2.TemplateSyntaxError when it does not parse."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def scored(data: dict) -> bool:
    """Whether a /v1/completions body takes the scoring path (`scored_completions`):
    logprobs, echo, or a batch of prompts."""
    lp, echo = data.get("logprobs"), data.get("echo")
    return (
        (lp is not None and lp is not False)
        or (echo is not None and echo is not False)
        or (is_batch(data.get("prompt")))
    )


def is_batch(prompt) -> bool:
    """Whether a completion's prompt is a batch: a list of strings or of token-id lists."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, (str, list)) for p in prompt)
    )


def scoring(data: dict) -> tuple[int | None, bool]:
    """(logprobs: alternatives per token or None, echo) of a completions body, checked."""
    f = _Scoring.checked(data)
    return None if f.logprobs is False else f.logprobs, bool(f.echo)


class Logprobs:
    """OpenAI's legacy completions `logprobs` object, built with one tokenizer:
    {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, one entry per token.

    A token's text is its own decode (a special token's text if that is empty); top_logprobs
    maps the texts of the N most likely tokens, then the token itself, to their log p (two ids
    of one text keep the first, the likelier); a score of None (the first echoed token, which
    nothing predicts) gives null for both. text_offset: where each token starts in the text,
    `base` plus the characters completed before it (a cut multi-byte character counts once
    it is whole)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}

    def text(self, token: int) -> str:
        if token not in self.texts:
            self.texts[token] = self.tokenizer.decode([token]) or self.tokenizer.special_text(token)
        return self.texts[token]

    def of(self, ids: list[int], scores: list, base: int, start: int = 0) -> dict:
        """The object of ids[start:], scores[i] = (log p, top ids, top log p) of ids[i] or None;
        offsets count from the start of `ids` (text at `base`)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i in range(start, len(ids)):
            out["tokens"].append(self.text(ids[i]))
            out["text_offset"].append(
                base + len(self.tokenizer.decode(ids[:i]).rstrip("\ufffd")) if i else base
            )
            if scores[i] is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            lp, top_ids, top_lps = scores[i]
            top: dict[str, float] = {}
            for t, v in zip((*top_ids, ids[i]), (*top_lps, lp)):
                top.setdefault(self.text(t), finite(v))
            out["token_logprobs"].append(finite(lp))
            out["top_logprobs"].append(top)
        return out

    @staticmethod
    def join(a: dict, b: dict) -> dict:
        return {k: a[k] + b[k] for k in a}


def finite(x: float) -> float:
    """A log-probability JSON can carry: -inf (and NaN) as -9999.0, as vLLM writes it."""
    return x if math.isfinite(x) else -9999.0


class Parsed(NamedTuple):
    """One checked prompt of a request and how to answer it."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stops: list[str]
    stream: bool
    usage: bool  # stream_options.include_usage


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
    """OpenAI's `usage` of the runs of one response."""
    p = sum(len(r.req.prompt) for r in runs)
    n = sum(len(r.text.tokens) for r in runs)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def event(obj) -> str:
    """One server-sent event of a JSON object."""
    return f"data: {json.dumps(obj)}\n\n"


NONFINITE_EVENT = event(
    {"error": {"message": NONFINITE_MESSAGE, "type": "server_error", "param": None, "code": None}}
)


async def disconnected(request: HTTPRequest) -> None:
    """Returns once the client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def parse_json(body: bytes) -> dict:
    """The JSON object of a request body; BadRequest (400) naming what is wrong."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("the body is not valid JSON here: it nests too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise BadRequest(f"the body is not valid JSON here: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    return data


class App:
    """The HTTP API of one started `Engine`: state (draining, metrics), authentication, request
    checks, one handler per endpoint, and the answering paths (plain, chat, scored), each
    request counted once in `metrics` by endpoint and status (499: the client went away).

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
        self.max_tokens_limit = max_tokens_limit or engine.length - 1
        self.template = None if chat_template is None else compile_chat_template(chat_template)
        self.metrics = Metrics(engine)
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

    def parse(self, data: dict, chat: bool) -> Parsed:
        """The checked request; BadRequest naming the first field that is wrong."""
        self.check_fields(data, chat)
        prompt, max_tokens = self.prompt_and_length(data, chat)
        f = _Sampling.checked(data, vocab=self.engine.config.vocab_size)
        sampling = Sampling(
            1.0 if f.temperature is None else f.temperature,
            f.top_k,
            f.top_p,
            secrets.randbelow(2**32) if f.seed is None else f.seed,
        )
        stops = [] if f.stop is None else [f.stop] if isinstance(f.stop, str) else f.stop
        usage = bool(f.stream_options and f.stream_options.include_usage)
        return Parsed(prompt, max_tokens, sampling, stops, bool(f.stream), usage)

    def check_fields(self, data: dict, chat: bool) -> None:
        """Only known fields, neutral values of those not supported, this server's model."""
        unknown = sorted(set(data) - (_CHAT if chat else _COMPLETION))
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r}", unknown[0])
        for field, ok in (_NEUTRAL if chat else _NEUTRAL_COMPLETION).items():
            if (
                field in data
                and not any(
                    data[field] == v and type(data[field]) is type(v) for v in ok if v is not None
                )
                and not (data[field] is None and None in ok)
            ):
                raise BadRequest(
                    f"{field}={data[field]!r} is not supported (only "
                    f"{ok[0] if ok[0] is not None else 'null'})",
                    field,
                )
        model = data.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(
                f"the model {model!r} does not exist: this server serves {self.model_name!r}",
                "model",
                status=404,
                code="model_not_found",
            )

    def prompt_and_length(self, data: dict, chat: bool) -> tuple[list[int], int]:
        """The prompt's ids and max_tokens (given, or what fits), within the positions."""
        length, limit = self.engine.length, self.max_tokens_limit
        where = "messages" if chat else "prompt"
        if chat:
            prompt = self.chat_prompt(data.get("messages"))
            key = (
                "max_completion_tokens"
                if data.get("max_completion_tokens") is not None
                else "max_tokens"
            )
        else:
            prompt, key = self.completion_prompt(data.get("prompt")), "max_tokens"
        max_tokens = data.get(key)
        if max_tokens is None:
            if len(prompt) >= length:  # no room left for even one token
                raise BadRequest(
                    f"the prompt has {len(prompt)} tokens, as many as this "
                    f"server's {length} positions per request or more: "
                    f"shorten it",
                    where,
                    code="context_length_exceeded",
                )
            max_tokens = min(limit if chat else 16, limit, length - len(prompt))
        low = 0 if not chat and data.get("echo") is True else 1  # 0: score the prompt only
        if not (is_int(max_tokens) and low <= max_tokens <= limit):
            raise BadRequest(
                f"{key}={max_tokens!r} must be an integer from {low} to "
                f"{limit}" + (" (0 only with echo=true)" if max_tokens == 0 and not chat else ""),
                key,
            )
        if len(prompt) + max_tokens > length:
            raise BadRequest(
                f"the prompt has {len(prompt)} tokens; with {key}={max_tokens} "
                f"that is {len(prompt) + max_tokens}, more than this server's "
                f"{length} positions per request: shorten the prompt "
                f"or lower {key}",
                where,
                code="context_length_exceeded",
            )
        return prompt, max_tokens

    def completion_prompt(self, prompt) -> list[int]:
        vocab = self.engine.config.vocab_size
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("prompt is empty", "prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"prompt has token ids outside [0, {vocab}): {bad[:5]}", "prompt")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1:
            raise BadRequest(
                "prompt must be one prompt (a string or a list of token ids); "
                "send one request per prompt",
                "prompt",
            )
        raise BadRequest("prompt must be a non-empty string or a list of token ids", "prompt")

    def chat_prompt(self, messages) -> list[int]:
        if self.template is None:
            raise BadRequest(
                f"the model {self.model_name!r} has no chat template: use "
                f"/v1/completions (or start the server with --chat-template)",
                "messages",
            )
        if not (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise BadRequest(
                "messages must be a non-empty list of {role, content} objects with string content",
                "messages",
            )
        try:
            return render_chat(self.template, messages, self.tokenizer)
        except TemplateRaised as e:
            raise BadRequest(f"the chat template refused these messages: {e}", "messages") from None
        except jinja2.TemplateError as e:
            raise BadRequest(
                f"the chat template failed on these messages: {e}", "messages"
            ) from None

    # -- answering --------------------------------------------------------------------------

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
            parsed = self.parse(data, chat)
        except BadRequest as e:
            return self.refused(endpoint, e)
        run = Run(self.tokenizer, parsed)
        refused = self.submit([run], endpoint)
        if refused is not None:
            return refused
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        if parsed.stream:
            chunk = self.plain_chunk(rid, chat)
            return self.streamed(
                run,
                endpoint,
                chunk,
                parsed.usage,
                head=chunk("", None, role=True) if chat else None,
            )
        outs = await self.collect(request, [run], endpoint)
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

    def refused(self, endpoint: str, e: BadRequest) -> Response:
        self.metrics.request(endpoint, e.status)
        if e.status == 499:
            return Response(status_code=499)
        return error(e.status, str(e), e.param, e.code)

    def submit(self, runs: list[Run], endpoint: str) -> Response | None:
        """Submits every run, or none (the counted 503 of a full queue, 400 of a prompt the
        engine refuses)."""
        try:
            for run in runs:
                self.engine.submit(run.req)
        except GenerationError as e:
            for run in runs:
                self.engine.cancel(run.req)
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
                if first and opening is not None and (opened := opening()) is not None:
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

    # -- /v1/completions with logprobs, echo or a batch of prompts -------------------------

    async def scored_completions(self, request: HTTPRequest, data: dict) -> Response:
        """Every prompt checked (as `parse` does one) before any is submitted; then one engine
        request per prompt, a choice each (index = the prompt's place), with OpenAI's legacy
        `logprobs` object if asked. Streamed: one prompt only."""
        top, echo = scoring(data)
        raw = data.get("prompt")
        prompts = raw if is_batch(raw) else [raw]
        parsed = self.parse_each(data, prompts)
        if parsed[0].stream and len(prompts) > 1:
            raise BadRequest(f"stream=true takes one prompt, got {len(prompts)}", "stream")
        runs = [Run(self.tokenizer, p, logprobs=top, echo=echo) for p in parsed]
        refused = self.submit(runs, "completions")
        if refused is not None:
            return refused
        echoed = [
            (p if isinstance(p, str) else self.tokenizer.decode(r.req.prompt)) if echo else ""
            for p, r in zip(prompts, runs)
        ]
        scores = Scores(Logprobs(self.tokenizer), top, echo)
        rid = "cmpl-" + secrets.token_hex(12)
        if parsed[0].stream:
            return self.scored_stream(runs[0], echoed[0], scores, rid, parsed[0].usage)
        outs = await self.collect(request, runs, "completions")
        if isinstance(outs, Response):
            return outs
        choices = [
            {
                "index": i,
                "text": pre + out,
                "logprobs": scores.whole(run, len(pre)),
                "finish_reason": reason,
            }
            for i, (run, (out, reason), pre) in enumerate(zip(runs, outs, echoed))
        ]
        self.metrics.request("completions", 200)
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": usage(runs),
            }
        )

    def parse_each(self, data: dict, prompts: list) -> list[Parsed]:
        """`parse` of the body with each prompt; an error names the prompt's place."""
        parsed = []
        for i, p in enumerate(prompts):
            try:
                parsed.append(self.parse({**data, "prompt": p}, chat=False))
            except BadRequest as e:
                if len(prompts) > 1 and e.param == "prompt":
                    e.args = (f"prompt {i}: {e}",)
                raise
        return parsed

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
        return self.logprobs.of(req.prompt, [None, *req.prompt_scores], 0)

    def new(self, run: Run, base: int, start: int) -> dict | None:
        """The generated tokens' object from token `start` on, offsets from `base`."""
        if self.top is None:
            return None
        return self.logprobs.of(run.text.tokens, run.req.scores, base, start)

    def whole(self, run: Run, base: int) -> dict | None:
        """The whole answer's object: the prompt's (with echo), then the generated tokens'."""
        lp = self.new(run, base, 0)
        if lp is not None and self.echo:
            lp = Logprobs.join(self.prompt(run), lp)
        return lp


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


def deadline_protocol(seconds: float):
    """uvicorn's h11 protocol class with a deadline: a connection must deliver one whole
    request (head and body) within `seconds` of opening or of its previous response, else it
    is closed (a body cut short reaches the app as a disconnect). uvicorn has no such timeout of
    its own (its keep-alive timeout starts only after a response), so partial requests held
    open would pin file descriptors forever.
    Use: `uvicorn.Config(app, http=deadline_protocol(30))`."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

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
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return DeadlineH11Protocol
