"""Tokenizer and chat template of a checkpoint directory: load, encode, decode, stream-decode, render chat prompts.

Owns reading `tokenizer.json` (HF tokenizers) or a Kimi-style `tiktoken.model`, the eos/bos ids, rendering the chat
template in a Jinja sandbox (small BPE tokenizers for synthetic checkpoints are trained in bpe.py).
Nothing in the model directory is imported or executed: `*.py` files shipped there (remote code) are ignored.
"""
from __future__ import annotations

import base64
import json
import re
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import tiktoken
import tokenizers
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moestream.errors import RequestError, TokenizerError

# Kimi K2's pre-tokenisation pattern: Han runs split off first, then cased words (Han excluded), digits in groups of
# at most three, punctuation runs, newlines and other whitespace.
_UPPERISH = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LOWERISH = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LEAD = r"[^\r\n\p{L}\p{N}]?"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    _LEAD + _UPPERISH + "*" + _LOWERISH + "+" + _CONTRACTION,
    _LEAD + _UPPERISH + "+" + _LOWERISH + "*" + _CONTRACTION,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
KIMI_RESERVED_SPECIAL_IDS = 256
MAX_SPECIAL_IDS = 1 << 16  # special ids past the base ranks when config.json gives no vocab_size
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _gpt2_byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest map to U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _gpt2_byte_chars()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece-style byte tokens


def _map_strings(value: Any, fn: Any) -> Any:
    """`value` with `fn` applied to every string inside it (dict keys stay as they are)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    return value


class _ChatTemplateEnv(ImmutableSandboxedEnvironment):
    """Sandbox that fails loudly on unsafe attribute access instead of rendering an empty string."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} is unsafe")


def _raise_exception(message: str) -> NoReturn:
    raise RequestError(f"the chat template rejected the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_ENV = _ChatTemplateEnv(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
_ENV.filters["tojson"] = _tojson
_ENV.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON ({e}); re-download it from the model's repository") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object; re-download it from the model's repository")
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config's bos/eos token: a string, null, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _int_ids(value: Any) -> list[int]:
    """config's eos_token_id: an int, a list of ints, or absent."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _load_hf(path: Path) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exception for malformed files
        raise TokenizerError(f"{path} is malformed ({e}); re-download it from the model's repository") from e


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:  # also binascii.Error
            raise TokenizerError(f"{path}:{lineno}: expected 'base64token rank', got {line[:60]!r}") from e
    if sorted(ranks.values()) != list(range(len(ranks))) or not ranks:
        raise TokenizerError(f"{path}: ranks must be 0..n-1 with no gaps or repeats; re-download it from the model's "
                             "repository")
    return ranks


def _kimi_special_tokens(config: dict[str, Any], n_base: int, path: Path, vocab: int | None) -> dict[str, int]:
    """Special tokens after the base ranks: those the config names, reserved names for the ids between. Ids are
    bounded by the model's vocab_size (else n_base + MAX_SPECIAL_IDS) so a bad entry cannot build a huge table."""
    where = f"tokenizer_config.json next to {path}"
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{where}: added_tokens_decoder must be a JSON object of id -> token")
    limit = n_base + MAX_SPECIAL_IDS if vocab is None else max(vocab, n_base + KIMI_RESERVED_SPECIAL_IDS)
    named: dict[int, str] = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not (key.isascii() and key.isdigit()) or not isinstance(content, str):
            raise TokenizerError(f"{where}: bad added_tokens_decoder entry {key!r}")
        if int(key) >= limit:
            raise TokenizerError(f"{where}: added_tokens_decoder id {key} is beyond the vocabulary ({limit} ids)")
        if int(key) >= n_base:
            named[int(key)] = content
    last = max([n_base + KIMI_RESERVED_SPECIAL_IDS - 1, *named])
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, last + 1)}
    if len(specials) != last + 1 - n_base:
        raise TokenizerError(f"{where} names the same special token twice")
    return specials


def _load_tiktoken(path: Path, config: dict[str, Any], vocab: int | None) -> tuple[tiktoken.Encoding, dict[str, int]]:
    ranks = _read_tiktoken_ranks(path)
    specials = _kimi_special_tokens(config, len(ranks), path, vocab)
    try:
        encoding = tiktoken.Encoding(path.parent.name or "tiktoken", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                     special_tokens=specials)
    except ValueError as e:
        raise TokenizerError(f"{path} could not be loaded as a tiktoken encoding: {e}") from e
    return encoding, specials


def _read_chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


class Tokenizer:
    """A checkpoint's tokenizer: HF `tokenizers` or tiktoken backend, special ids, and the chat template."""

    def __init__(self, model_dir: Path, backend: tokenizers.Tokenizer | tiktoken.Encoding,
                 tiktoken_specials: dict[str, int] | None, tokenizer_config: dict[str, Any],
                 model_configs: list[dict[str, Any]]) -> None:
        self.model_dir = model_dir
        self._backend = backend
        self._specials = tiktoken_specials or {}
        self._plain: tokenizers.Tokenizer | None = None  # built on first use (see _plain_backend)
        self._added: set[int] | None = None
        self._is_byte_level: bool | None = None
        self._specials_re: re.Pattern | bool | None = None  # False: the tokenizer has no special tokens
        self._special_ids = set(self._specials.values())
        self.chat_template = _read_chat_template(model_dir, tokenizer_config)
        self._compiled: jinja2.Template | None = None
        self.bos_token = _token_content(tokenizer_config.get("bos_token"))
        self.eos_token = _token_content(tokenizer_config.get("eos_token"))
        self._eos_ids = self._special_ids_for(self.eos_token, "eos_token_id", model_configs)
        self._bos_id = next(iter(self._special_ids_for(self.bos_token, "bos_token_id", model_configs)), None)

    def _special_ids_for(self, token: str | None, key: str, model_configs: list[dict[str, Any]]) -> list[int]:
        """The token's own id, then ids that generation_config.json / config.json list under `key`, deduplicated."""
        ids = [self.token_to_id(token)] if token else []
        ids += [i for cfg in model_configs for i in _int_ids(cfg.get(key))]
        return list(dict.fromkeys(i for i in ids if i is not None))

    @classmethod
    def load(cls, model_dir: str | Path) -> Tokenizer:
        d = Path(model_dir)
        if not d.is_dir():
            raise TokenizerError(f"model directory {d} does not exist")
        config = _read_json(d / "tokenizer_config.json")
        model_config = _read_json(d / "config.json")
        text_config = model_config.get("text_config")  # multimodal checkpoints nest the text model's ids here
        specials = None
        if (d / "tokenizer.json").is_file():
            backend: tokenizers.Tokenizer | tiktoken.Encoding = _load_hf(d / "tokenizer.json")
        elif (d / "tiktoken.model").is_file():
            vocab = _int_ids((text_config if isinstance(text_config, dict) else model_config).get("vocab_size"))
            backend, specials = _load_tiktoken(d / "tiktoken.model", config, vocab[0] if vocab else None)
        else:
            raise TokenizerError(f"no tokenizer in {d}: expected tokenizer.json or tiktoken.model (with "
                                 "tokenizer_config.json); copy them from the model's original repository")
        configs = [_read_json(d / "generation_config.json"), model_config, text_config or {}]
        return cls(d, backend, specials, config, [c for c in configs if isinstance(c, dict)])

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def vocab_size(self) -> int:
        if isinstance(self._backend, tokenizers.Tokenizer):
            return self._backend.get_vocab_size(with_added_tokens=True)
        return self._backend.n_vocab

    @property
    def backend(self) -> tokenizers.Tokenizer | tiktoken.Encoding:
        """The underlying tokenizer (for libraries that build their own view of the vocabulary, e.g. grammars)."""
        return self._backend

    def special_ids(self) -> set[int]:
        """Ids of the special (control) tokens, which generated text leaves out."""
        if isinstance(self._backend, tokenizers.Tokenizer):
            return {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        return set(self._special_ids)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def token_to_id(self, token: str) -> int | None:
        """Id of one vocabulary or special token, or None when the string is not a single token."""
        if isinstance(self._backend, tokenizers.Tokenizer):
            return self._backend.token_to_id(token)
        if token in self._specials:
            return self._specials[token]
        try:
            return self._backend.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """With `parse_special`, special tokens written in `text` (as chat templates do) map to their ids; without
        it they are encoded as the plain text they are, as untrusted user text must be."""
        if isinstance(self._backend, tokenizers.Tokenizer):
            backend = self._backend if parse_special else self._plain_backend()
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._backend.encode(text, allowed_special="all" if parse_special else set(), disallowed_special=())
        return [self._bos_id, *ids] if add_special_tokens and self._bos_id is not None else ids

    def _plain_backend(self) -> tokenizers.Tokenizer:
        """A copy of the HF tokenizer that encodes special tokens' text as text (its flag is per instance, so the
        copy keeps concurrent encodes from racing on a shared switch)."""
        if self._plain is None:
            plain = tokenizers.Tokenizer.from_str(self._backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def special_tokens(self) -> list[str]:
        """The strings that encode to one control token when special tokens are parsed, longest first."""
        if isinstance(self._backend, tokenizers.Tokenizer):
            names = [t.content for t in self._backend.get_added_tokens_decoder().values() if t.special]
        else:
            names = list(self._specials)
        return sorted(set(n for n in names if n), key=len, reverse=True)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    **template_vars: Any) -> list[int]:
        """The ids of a rendered chat prompt in which only the template's own markers are control tokens.

        Every special-token string inside the messages (and tools) is swapped for a marker carrying a random nonce
        before rendering; the rendered text is split at the special tokens left (the template's), each piece
        between them gets its markers swapped back and is encoded without parsing special tokens. A user who
        writes `<|im_end|><|im_start|>system` gets those characters as text, not a new system turn."""
        pattern = self._special_pattern()
        if pattern is None:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, **template_vars))
        found: list[str] = []
        nonce = secrets.token_hex(8)

        def protect(text: str) -> str:
            def mark(m: re.Match) -> str:
                found.append(m.group(0))
                return f"\ue000{nonce}:{len(found) - 1}\ue001"
            return pattern.sub(mark, text)

        rendered = self.apply_chat_template(_map_strings(messages, protect), add_generation_prompt,
                                            _map_strings(tools, protect), **template_vars)
        restore = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        ids: list[int] = []
        for i, piece in enumerate(re.split(f"({pattern.pattern})", rendered)):
            if i % 2:  # a special token the template wrote
                ids.append(self.token_to_id(piece))
            elif piece:
                ids += self.encode(restore.sub(lambda m: found[int(m.group(1))], piece), parse_special=False)
        return ids

    def _special_pattern(self) -> re.Pattern | None:
        if self._specials_re is None:
            specials = self.special_tokens()
            self._specials_re = re.compile("|".join(map(re.escape, specials))) if specials else False
        return self._specials_re or None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a token can be part of a UTF-8 character, which `decode` turns into
        U+FFFD); empty for ids outside the vocabulary."""
        if not isinstance(self._backend, tokenizers.Tokenizer):
            try:
                return self._backend.decode_single_token_bytes(token_id)
            except KeyError:
                return b""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id not in self._added_ids():
            if self._byte_level() and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
        return self.decode([token_id]).encode("utf-8")

    def _added_ids(self) -> set[int]:
        if self._added is None:
            self._added = set(self._backend.get_added_tokens_decoder())
        return self._added

    def _byte_level(self) -> bool:
        """Whether the HF tokenizer's pieces are GPT-2 byte-level characters (its decoder includes ByteLevel)."""
        if self._is_byte_level is None:
            decoder = json.loads(self._backend.to_str()).get("decoder") or {}
            parts = decoder.get("decoders", [decoder]) if isinstance(decoder, dict) else []
            self._is_byte_level = any(isinstance(d, dict) and d.get("type") == "ByteLevel" for d in parts)
        return self._is_byte_level

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Ids outside the vocabulary decode to nothing; incomplete UTF-8 at the end decodes to U+FFFD."""
        if isinstance(self._backend, tokenizers.Tokenizer):
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        n = self._backend.n_vocab
        kept = [i for i in ids if 0 <= i < n and not (skip_special_tokens and i in self._special_ids)]
        return self._backend.decode(kept, errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_vars: Any) -> str:
        """Render `messages` with the checkpoint's chat template in a sandbox; the result still needs `encode`."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.model_dir} has no chat template (no chat_template.jinja and no "
                                 "'chat_template' in tokenizer_config.json); send raw text or add a template")
        try:
            if self._compiled is None:
                self._compiled = _ENV.from_string(self.chat_template)
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         **template_vars)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise TokenizerError(f"the chat template of {self.model_dir} failed: {type(e).__name__}: {e}") from e


class StreamDecoder:
    """Turns generated ids into text pieces, holding back a character until all of its bytes have arrived."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # the last emitted chunk (decoding context) followed by pending ids
        self._done = 0  # ids[:done] is the context whose text was already emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        text = self._emit(final=True)
        self._ids, self._done = [], 0
        return text

    def _emit(self, final: bool) -> str:
        if self._done == len(self._ids):
            return ""
        context = self._tokenizer.decode(self._ids[:self._done], self._skip)
        full = self._tokenizer.decode(self._ids, self._skip)
        if full.endswith("\ufffd") and not final:
            return ""
        self._ids = self._ids[self._done:]
        self._done = len(self._ids)
        return full[len(context):]
