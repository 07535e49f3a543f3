"""Tokenizers: the embedded byte-level default (`ByteTokenizer`, no download) and a local Hugging
Face `tokenizer.json` (`HFTokenizer`), alike: `encode(text, bos=, eos=)`, `decode(ids)`,
`vocab_size`, `bos_id` / `eos_id` / `pad_id`, `add_bos`, `chat_template`. Ids and the BOS
convention: docs/training.md, 'Tokenizers'.

    tok = make_tokenizer("byte")        # or the path of a tokenizer.json (`data.tokenizer`)"""

from __future__ import annotations

import json
import os
import shutil

from tokenizers import Tokenizer

from ladder_jax.config import ConfigError


class ByteTokenizer:
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259
    add_bos = True  # the models of this package are trained with a BOS before every text
    chat_template = None

    def encode(self, text: str, *, bos: bool | None = None, eos: bool = False) -> list[int]:
        """UTF-8 bytes, BOS first unless bos=False (None: `add_bos`), EOS last if eos."""
        bos = self.add_bos if bos is None else bos
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def special_text(self, token_id: int | None) -> str:
        """A special token's text (what chat templates call bos_token): bytes have none."""
        return ""

    def decode(self, ids) -> str:
        """Bytes back to text; specials are dropped, broken UTF-8 shows as U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self):
        return "ByteTokenizer(bytes 0-255, BOS=256, EOS=257, PAD=258)"


class HFTokenizer:
    """A checkpoint's `tokenizer.json` (the `tokenizers` package), with the interface of
    `ladder_jax.interop.tokenizer.ByteTokenizer`: encode(text, bos=, eos=) -> ids, decode(ids).

        tok = HFTokenizer.from_dir("SmolLM2/")     # tokenizer.json (+ tokenizer_config.json)
        HFTokenizer(tokenizer=tokenizers.Tokenizer(...), bos_id=1, add_bos=False)  # in memory

    `add_bos` None: whether the tokenizer's post-processor puts `bos_id` first."""

    def __init__(
        self,
        file: str | None = None,
        *,
        bos_id=None,
        eos_id=None,
        pad_id=None,
        add_bos: bool | None = None,
        chat_template: str | None = None,
        tokenizer: Tokenizer | None = None,
        config: dict | None = None,
    ):
        self.file = file
        if tokenizer is not None:
            self._tok = tokenizer
        else:
            try:
                self._tok = Tokenizer.from_file(file)
            except Exception as e:  # the tokenizers package raises bare Exceptions
                raise ConfigError(
                    f"{file} is not a tokenizer.json the tokenizers package can "
                    f"read ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                    f": fetch it again"
                ) from None
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self._add_bos = add_bos
        self.chat_template = chat_template
        self._config = dict(config or {})  # tokenizer_config.json as read, rewritten by save
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        self._prepended = (
            full[0] if len(full) > len(plain) and full[:1] != plain[:1] else None
        )  # what the post-processor puts first, if anything

    @property
    def add_bos(self) -> bool:
        """Whether `encode(text)` starts with BOS: tokenizer_config.json's add_bos_token, else
        whether the post-processor prepends BOS (transformers' rule)."""
        if self._add_bos is not None:
            return self._add_bos
        return self.bos_id is not None and self._prepended == self.bos_id

    @add_bos.setter
    def add_bos(self, value: bool | None) -> None:
        self._add_bos = value

    @classmethod
    def from_dir(cls, path: str, hf: dict | None = None) -> HFTokenizer | None:
        """The tokenizer of an HF model directory, or None if it has no tokenizer.json. Special
        ids come from config.json, else tokenizer_config.json's token strings; add_bos and the
        chat template from tokenizer_config.json (or chat_template.jinja)."""
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            return None
        hf = hf or {}
        names = {}
        tc = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(tc):
            try:
                with open(tc, encoding="utf-8") as f:
                    names = json.load(f)
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot read {tc}: {e}") from None
            if not isinstance(names, dict):
                raise ConfigError(f"{tc} holds a JSON {type(names).__name__}, not an object")
        template = names.get("chat_template")
        jinja = os.path.join(path, "chat_template.jinja")  # where transformers 5 writes it
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        add_bos = names.get("add_bos_token")
        tok = cls(
            file,
            add_bos=add_bos if isinstance(add_bos, bool) else None,
            chat_template=template if isinstance(template, str) else None,
            config=names,
        )

        def special(key):
            v = hf.get(f"{key}_token_id")
            if isinstance(v, list):  # llama-3 instruct lists several EOS ids: take the first
                v = v[0] if v else None
            if v is None:
                s = names.get(f"{key}_token")
                s = s.get("content") if isinstance(s, dict) else s
                v = tok._tok.token_to_id(s) if isinstance(s, str) else None
            return v

        tok.bos_id, tok.eos_id, tok.pad_id = special("bos"), special("eos"), special("pad")
        return tok

    def guess_specials(self) -> None:
        """Without a config beside the tokenizer.json, find BOS / EOS by their usual names."""
        for attr, names in (
            ("bos_id", ("<s>", "<|begin_of_text|>", "<bos>")),
            ("eos_id", ("</s>", "<|end_of_text|>", "<eos>")),
        ):
            if getattr(self, attr) is None:
                setattr(
                    self,
                    attr,
                    next((i for i in map(self._tok.token_to_id, names) if i is not None), None),
                )

    def encode(self, text: str, *, bos: bool | None = None, eos: bool = False) -> list[int]:
        """Token ids of `text`; BOS first when bos (None: `add_bos`), EOS last when eos."""
        bos = self.add_bos if bos is None else bos
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return (
            ([self.bos_id] if bos and self.bos_id is not None else [])
            + ids
            + ([self.eos_id] if eos and self.eos_id is not None else [])
        )

    def special_text(self, token_id: int | None) -> str:
        """A special token's text (what chat templates call bos_token), "" if none."""
        return (self._tok.id_to_token(token_id) or "") if token_id is not None else ""

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, path: str) -> None:
        """tokenizer.json and tokenizer_config.json (add_bos_token, the special tokens' text,
        the chat template) into the directory `path`, which transformers and `from_dir` read."""
        if self.file is not None:
            shutil.copyfile(self.file, os.path.join(path, "tokenizer.json"))
        else:
            self._tok.save(os.path.join(path, "tokenizer.json"))
        config = {**self._config, "add_bos_token": self.add_bos}
        for key in ("bos", "eos", "pad"):
            token_id = getattr(self, f"{key}_id")
            if token_id is not None:
                config[f"{key}_token"] = self.special_text(token_id)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)

    def __repr__(self):
        return (
            f"HFTokenizer({self.file or 'in memory'}, vocab {self.vocab_size}, "
            f"bos={self.bos_id}, eos={self.eos_id}, add_bos={self.add_bos})"
        )


def make_tokenizer(name: str):
    """`byte` (the embedded default) or a local tokenizer.json (`data.tokenizer`)."""
    if name == "byte":
        return ByteTokenizer()
    if not os.path.isfile(name):
        raise ConfigError(f"data.tokenizer={name!r}: no such file (give a tokenizer.json or byte)")
    directory = os.path.dirname(os.path.abspath(name))
    tok = (
        HFTokenizer.from_dir(directory) if os.path.basename(name) == "tokenizer.json" else None
    ) or HFTokenizer(name)
    tok.guess_specials()
    return tok
