"""A served model's tokenizer and chat template for processes that must not import transformers (the API).

The model directory's `tokenizer.json` is loaded with the `tokenizers` library and its chat template is
rendered with jinja2 the way transformers renders it (sandboxed, trim_blocks / lstrip_blocks, `tojson`,
`raise_exception`), so `render` + `encode` give the ids `AutoTokenizer.apply_chat_template` gives (a test
compares the two on the tiny model).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from twinkle.errors import InvalidRequest

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        tokenizer_file = self.model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise InvalidRequest(f"The model at {self.model_dir.name} has no tokenizer.json, so the server cannot "
                                 "tokenize text for it.", hint="Send token ids through the Tinker sample API.")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config_file = self.model_dir / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special_tokens = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        self.chat_template = _chat_template(self.model_dir, config)
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = self.tokenizer.token_to_id(eos) if eos else None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the model's chat template writes it, ending in an assistant turn's header."""
        if self.chat_template is None:
            raise InvalidRequest(f"The model {self.model_dir.name} has no chat template.",
                                 hint="Use /v1/completions with a plain prompt instead.")
        from jinja2.exceptions import TemplateError

        try:
            return _compiled(self.chat_template).render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                tools=None, documents=None, **{k: v for k, v in self.special_tokens.items() if v is not None})
        except TemplateError as exc:
            raise InvalidRequest(f"The model's chat template refused these messages: {exc}",
                                 hint="Check the roles and their order (e.g. one system message first).") from None

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`; a rendered chat already holds its special tokens, a plain prompt may get a BOS."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        """One token as text (for logprob listings)."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes: its UTF-8 text, or for a token holding part of a character (which decodes to
        U+FFFD alone) the raw bytes of its byte-level or `<0xNN>` piece."""
        text = self.token_text(token_id)
        if "\ufffd" in text and (raw := _raw_bytes(self.tokenizer.id_to_token(token_id))) is not None:
            return raw
        return text.encode()

    def token_key(self, token_id: int) -> str:
        """A token as OpenAI's legacy logprob listings name it: its text, or `bytes:\\xNN...` for a token that
        is part of a character (so distinct partial tokens do not all read as U+FFFD)."""
        text = self.token_text(token_id)
        if "\ufffd" not in text or (raw := _raw_bytes(self.tokenizer.id_to_token(token_id))) is None:
            return text
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, char -> byte (printable bytes stand for themselves, the rest are
    shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


def _raw_bytes(piece: str | None) -> bytes | None:
    """The bytes a vocabulary piece stands for: `<0xNN>` (SentencePiece byte fallback) or byte-level BPE."""
    if piece is None:
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    alphabet = _byte_level_alphabet()
    if all(char in alphabet for char in piece):
        return bytes(alphabet[char] for char in piece)
    return None


@functools.cache
def load_chat_tokenizer(model_dir: str) -> ChatTokenizer:
    """One tokenizer per model directory and process (loading one takes tens of milliseconds)."""
    return ChatTokenizer(model_dir)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # the AddedToken form {"content": ..., ...}
        return str(value.get("content")) if value.get("content") is not None else None
    return str(value) if value is not None else None


def _chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    file = model_dir / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return str(template) if template else None


@functools.cache
def _compiled(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' filter: json.dumps without HTML escaping, unlike jinja2's built-in tojson
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)
