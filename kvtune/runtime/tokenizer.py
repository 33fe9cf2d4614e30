"""Text <-> token ids for a Hugging Face folder: tokenizer.json through `tokenizers`, and the
model's chat template rendered with jinja2 the way transformers renders it.

DESIGN.md section 7: SmolLM2 answers through its chat template and mostly fails without it, so
prompts of chat models go through `encode_chat`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvtune.runtime.errors import ConfigError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any
) -> str:
    """transformers' tojson filter (jinja2's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: str | Mapping[str, Any] | None) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, Mapping) else token


def _ids(value: int | Iterable[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja (transformers 5), else tokenizer_config's (a string or named list)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


class Tokenizer:
    """Encode, decode and chat formatting of one model.

    eos_token_ids: every id that ends generation: the tokenizer's eos token and the
    eos_token_id of generation_config.json (else config.json), e.g. Llama 3's several ids.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str | None],
        chat_template: str | None,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.backend = backend
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        self.eos_token_ids = tuple(eos_token_ids)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load tokenizer.json and tokenizer_config.json (+ generation/model config eos ids)."""
        path = Path(folder).expanduser()
        if not (path / "tokenizer.json").is_file():
            raise ConfigError("model.path", str(folder), "a folder containing tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        generation = _read_json(path / "generation_config.json") or _read_json(path / "config.json")
        eos = _ids(backend.token_to_id(special["eos_token"]) if special["eos_token"] else None)
        eos += [i for i in _ids(generation.get("eos_token_id")) if i not in eos]
        return cls(backend, special, _chat_template(path, config), eos)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, name: str) -> int | None:
        """Id of a special token by role (bos_token, eos_token, unk_token, pad_token)."""
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; special-token strings in text become their single ids.

        add_special_tokens applies tokenizer.json's post-processor (for example Llama 3's BOS),
        as transformers does by default.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ConfigError("model.chat_template", None, "a tokenizer with a chat template")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of a conversation ({"role": ..., "content": ...} messages);
        add_generation_prompt opens the assistant's turn."""
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered conversation; the template writes its own special tokens."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False)
