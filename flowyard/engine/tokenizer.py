"""Tokenizer, chat template and streaming detokenizer for the real engine.

A thin layer over `tokenizers.Tokenizer` so the engine does not depend on transformers at run
time. It is built either from a Hugging Face `tokenizer.json` or from the vocabulary a GGUF
file carries in its metadata; for GGUF it reproduces what transformers builds from the same
file (byte-level BPE, control tokens as special tokens), so token ids agree exactly.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

# llama.cpp's pre-tokenizer names -> split regex (same table as transformers' GGUF loader);
# a name not listed keeps the GPT-2 regex built into the ByteLevel pre-tokenizer.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")}
_PRE_SPLITS.update({name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen", "megrez")})
# Texts llama.cpp treats as end-of-generation when they are control tokens of a GGUF vocab.
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
              "<EOT>", "<|end_of_text|>", "<|return|>", "<|call|>"}
_CONTROL, _USER_DEFINED = 3, 4


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    """Encode/decode plus the model's chat template; satisfies `protocol.TokenizerLike`."""

    def __init__(self, backend: _Backend, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                 chat_template: str | None = None, special_tokens: Mapping[str, str] | None = None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        # bos_token/eos_token/... strings the template may reference (HF passes special_tokens_map).
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._compiled: jinja2.Template | None = None

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """Build from `tokenizer.ggml.*` metadata, the way transformers converts a GGUF vocab."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        backend = _Backend(models.BPE(vocab, merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                                      end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
        split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        # Control tokens stay whole and are skipped in decode; a "control" token spelled outside
        # the byte alphabet is a llama.cpp mislabel and is left alone (as transformers does).
        control = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
        backend.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
        if user:
            backend.add_tokens(user)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)])
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
        eos += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _CONTROL and t in _EOG_TEXTS]
        named = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                 "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
        special = {name: tokens[meta[f"tokenizer.ggml.{key}"]] for name, key in named.items()
                   if meta.get(f"tokenizer.ggml.{key}") is not None}
        return cls(backend, bos_token_id=bos, eos_token_ids=eos,
                   chat_template=meta.get("tokenizer.chat_template"), special_tokens=special)

    @classmethod
    def from_hf_files(cls, tokenizer_json: str, tokenizer_config: Mapping[str, Any] | None = None,
                      chat_template: str | None = None, bos_token_id: int | None = None,
                      eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        """Build from `tokenizer.json` (+ tokenizer_config.json); ids from config.json are fallbacks."""
        backend = _Backend.from_file(tokenizer_json)
        tc = dict(tokenizer_config or {})
        special: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = tc.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[name] = value
        bos_tok = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
        eos_tok = backend.token_to_id(special["eos_token"]) if "eos_token" in special else None
        eos = list(eos_token_ids) + ([eos_tok] if eos_tok is not None else [])
        if chat_template is None:
            chat_template = _pick_template(tc.get("chat_template"))
        return cls(backend, bos_token_id=bos_tok if bos_tok is not None else bos_token_id, eos_token_ids=eos,
                   chat_template=chat_template, special_tokens=special)

    # --- encode / decode ----------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special-token text in `text` (e.g. `<|im_start|>`) maps to its single id."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def detokenizer(self, skip_special_tokens: bool = True,
                    context_ids: Sequence[int] = ()) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens, context_ids=context_ids)

    # --- chat ---------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render the conversation as transformers' `apply_chat_template(tokenize=False)` does.

        Raises ValueError when the model has no template or the template rejects the input
        (templates call `raise_exception`), so the server can answer 400.
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        chat = [_plain(m) for m in messages]
        for m in chat:
            if not isinstance(m, dict):
                raise ValueError(f"chat messages must be objects, got {m!r}")
        variables = {**self.special_tokens, **{k: _plain(v) for k, v in kwargs.items()}}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            return self._compiled.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas that never end inside a UTF-8 character.

    Keeps a short window (prefix_offset..read_offset) of already-emitted tokens and re-decodes
    window + new tokens, emitting only the text past the window once it no longer ends in U+FFFD
    (an incomplete byte sequence). The concatenated deltas plus `flush()` equal `decode(ids)`.
    `context_ids` (e.g. the prompt's last tokens) seed the window so tokenizers whose decoder
    strips a leading space (SentencePiece) keep it on the first generated token.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(context_ids)[-6:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly "")."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def push_many(self, token_ids: Sequence[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """Emit whatever is held back (at end of stream: an incomplete character as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    """Same environment as transformers: sandboxed, trim/lstrip blocks, loopcontrols, HF globals."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"invalid chat template: {exc}") from exc


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template is a string or a list of {name, template}: take 'default'."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


def _plain(value: Any) -> Any:
    """Deep-copy request data into plain JSON types before the sandboxed template sees it."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, str):  # subclasses (enums...) are cut back to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"
