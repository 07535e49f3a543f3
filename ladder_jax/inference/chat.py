"""Chat templates, compiled and rendered one way for the server and `decode --chat` (jinja2 in a
sandbox, as transformers' `apply_chat_template`); every failure is one `ChatTemplateError`.

    ids = render_chat(compile_chat_template(source), messages, tokenizer)"""

from __future__ import annotations

import jinja2.sandbox


class ChatTemplateError(ValueError):
    """A chat template that does not parse, refused the messages or failed on them."""


class TemplateRaised(jinja2.TemplateError):
    """A chat template's own `raise_exception(message)`: the message is for the user."""


def _raise_exception(message):
    raise TemplateRaised(str(message))


_ENVIRONMENT = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_ENVIRONMENT.globals["raise_exception"] = _raise_exception


def compile_chat_template(source: str):
    """The compiled template; ChatTemplateError (with the line) when it does not parse."""
    try:
        return _ENVIRONMENT.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the chat template is not valid Jinja (line {e.lineno}: {e.message})"
        ) from None


def render_chat(template, messages: list[dict], tokenizer) -> list[int]:
    """The prompt ids of `messages` through a compiled chat template. The template sees the
    tokenizer's BOS / EOS strings (`bos_token`, `eos_token`, as in transformers'
    `apply_chat_template`; empty for the byte tokenizer, which has no text for them). The text
    gets the tokenizer's own BOS convention (`add_bos`; none for SmolLM2's), except that a text
    that starts with the BOS string gets no second BOS. ChatTemplateError when the template
    refuses the messages (`raise_exception`) or fails on them."""
    bos, eos = (tokenizer.special_text(i) for i in (tokenizer.bos_id, tokenizer.eos_id))
    try:
        text = template.render(
            messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
        )
    except TemplateRaised as e:
        raise ChatTemplateError(f"the chat template refused these messages: {e}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None
    return tokenizer.encode(text, bos=False if bos and text.startswith(bos) else None)
