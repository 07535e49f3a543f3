"""The OpenAI request and response schema of the server (pydantic, strict): body fields and their
fixed limits, the error body, the legacy `logprobs` object, server-sent event framing. Pure data.

    data = parse_json(body); top, echo = scoring(data)"""

from __future__ import annotations

import json
import math
from typing import Annotated, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.responses import JSONResponse

from ladder_jax.inference.generation import TOP_LOGPROBS
from ladder_jax.inference.sampling import Sampling

NONFINITE_MESSAGE = (
    "the model's logits are NaN or infinite: its weights are broken (a "
    "checkpoint of a run that diverged?); no tokens are drawn from them"
)
UNAUTHORIZED = "missing or wrong API key: send Authorization: Bearer KEY"

# fields accepted as OpenAI sends them; the `only` ones must keep their neutral value
COMMON_FIELDS = {
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
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
NEUTRAL = {
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
NEUTRAL_COMPLETION = {k: v for k, v in NEUTRAL.items() if k not in ("logprobs", "echo")}


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


class Checked(BaseModel):
    """Declared types and ranges of body fields whose limits are fixed (pydantic, strict: no
    "1" for 1, no true for 1). `checked` raises the BadRequest of the first wrong field in
    declaration order, with its message from `_SAYS`."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @classmethod
    def checked(cls, data: dict, **limits):
        try:
            return cls.model_validate(data, context=limits)
        except ValidationError as e:
            loc = e.errors()[0]["loc"]
            field, value = loc[0], data.get(loc[0])
            if loc[:2] == ("stream_options", "include_usage"):
                field, value = "stream_options.include_usage", value["include_usage"]
            raise BadRequest(_SAYS[field].format(value, **limits), loc[0]) from None


_Stop = Annotated[str, Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None


class SamplingFields(Checked):
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1, 0: off (vLLM's spellings)
    seed: Annotated[int, Field(ge=0, lt=2**32)] | None = None
    stop: _Stop | Annotated[list[_Stop], Field(max_length=4)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None

    @field_validator("top_k")
    @classmethod
    def _in_vocab(cls, top_k, info):
        if top_k is not None and top_k > info.context["vocab"]:
            raise ValueError("past the vocabulary")
        return None if top_k in (-1, 0) else top_k


class ScoringFields(Checked):
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
    "stream_options.include_usage": "stream_options.include_usage={!r} must be true or false",
    "logprobs": f"logprobs={{!r}} must be an integer from 0 to {TOP_LOGPROBS} (or null)",
    "echo": "echo={!r} must be true or false",
}


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
    f = ScoringFields.checked(data)
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

    def of(self, ids: list[int], scores: list, starts: list[int], base: int, start: int = 0):
        """The object of ids[start:], scores[i] = (log p, top ids, top log p) of ids[i] or None;
        starts[i]: the characters of whole text before ids[i] (`Detokenizer.starts`), offsets
        at `base` plus those."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i in range(start, len(ids)):
            out["tokens"].append(self.text(ids[i]))
            out["text_offset"].append(base + starts[i])
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


def event(obj) -> str:
    """One server-sent event of a JSON object."""
    return f"data: {json.dumps(obj)}\n\n"


NONFINITE_EVENT = event(
    {"error": {"message": NONFINITE_MESSAGE, "type": "server_error", "param": None, "code": None}}
)


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
    for key, value in data.items():
        bad = _lone_surrogate(key, value)
        if bad is not None:
            raise BadRequest(
                f"{key!r} holds {bad!r}, a lone surrogate: not Unicode text (send each "
                f"character whole, a pair of surrogates above U+FFFF)",
                key if isinstance(key, str) and _lone_surrogate(key, "") is None else None,
            )
    return data


def _lone_surrogate(key, value) -> str | None:
    """The first lone surrogate (JSON allows "\\ud800" alone; UTF-8 cannot carry it) in a
    key or anywhere in a value, else None (no recursion: the nesting is JSON's)."""
    stack = [key, value]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                return x[e.start]
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return None
