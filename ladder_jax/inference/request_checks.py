"""The checks of one completion or chat request body against the engine it goes to (fields, model
name, prompt, `max_tokens`, sampling); each failure is one `BadRequest` naming the field.

    parsed = RequestChecks(engine, tokenizer, model_name="tiny").parse(data, chat=False)"""

from __future__ import annotations

import secrets

from ladder_jax.inference.chat import ChatTemplateError, compile_chat_template, render_chat
from ladder_jax.inference.openai_schema import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    NEUTRAL,
    NEUTRAL_COMPLETION,
    BadRequest,
    Parsed,
    SamplingFields,
)
from ladder_jax.inference.sampling import Sampling, is_int


class RequestChecks:
    """Parses request bodies for one engine (its positions per request and vocabulary) and
    tokenizer; `chat_template` (source text) enables chat messages."""

    def __init__(
        self,
        engine,
        tokenizer,
        *,
        model_name: str,
        max_tokens_limit: int | None = None,
        chat_template: str | None = None,
    ):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_tokens_limit = max_tokens_limit or engine.length - 1
        self.template = None if chat_template is None else compile_chat_template(chat_template)

    def parse(self, data: dict, chat: bool) -> Parsed:
        """The checked request; BadRequest naming the first field that is wrong."""
        self.check_fields(data, chat)
        prompt, max_tokens = self.prompt_and_length(data, chat)
        f = SamplingFields.checked(data, vocab=self.engine.config.vocab_size)
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
        unknown = sorted(set(data) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r}", unknown[0])
        for field, ok in (NEUTRAL if chat else NEUTRAL_COMPLETION).items():
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
        except ChatTemplateError as e:
            raise BadRequest(str(e), "messages") from None

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
