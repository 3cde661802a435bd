"""Text <-> token ids and chat templating, for a GGUF file or a Hugging Face directory.

For a GGUF file the ``tokenizers.Tokenizer`` is built directly from the vocabulary and merges in
the file's metadata (a few tens of milliseconds), instead of going through transformers' GGUF
conversion (seconds).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from radixmesh.core.detokenize import REPLACEMENT_CHAR
from radixmesh.core.gguf import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_USER_DEFINED,
    gguf_eos_token_ids,
    read_gguf,
)
from radixmesh.core.model_files import resolve_model_path

log = logging.getLogger(__name__)

# Split patterns of the byte-level BPE families, keyed by GGUF ``tokenizer.ggml.pre``.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PATTERNS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx", "pixtral"),
        _LLAMA3_PATTERN,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_PATTERN),
}
# Pre-tokenizers that isolate every digit before the GPT-2 byte-level split (SmolLM, StarCoder).
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_GPT2_PRE = frozenset({"default", "gpt-2", "gpt2", "olmo", "jais", "poro-chat", "viking"})


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _SPLIT_PATTERNS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PATTERNS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _GPT2_PRE and pre is not None:
        log.warning("unknown GGUF pre-tokenizer %r; using the GPT-2 byte-level split", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _bos_processor(bos_token: str, bos_id: int) -> processors.PostProcessor:
    return processors.TemplateProcessing(
        single=f"{bos_token}:0 $A:0",
        pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos_id)],
    )


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the model's special tokens and chat template."""

    def __init__(
        self,
        raw: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool = False,
        source: str = "",
    ) -> None:
        self._raw = raw
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self.source = source
        self._bos_id = raw.token_to_id(bos_token) if bos_token is not None else None
        ids: list[int] = []
        eos_id = raw.token_to_id(eos_token) if eos_token is not None else None
        for i in ([eos_id] if eos_id is not None else []) + list(eos_token_ids):
            if i not in ids:
                ids.append(int(i))
        self._eos_ids = tuple(ids)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_path(cls, path: str | None) -> Tokenizer:
        """None -> the default SmolLM2 GGUF; a .gguf file; or a Hugging Face directory."""
        resolved = resolve_model_path(path)
        if resolved.is_dir():
            return cls.from_hf_dir(resolved)
        return cls.from_gguf(resolved)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build a byte-level BPE tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata."""
        gf = read_gguf(path, tensors=False)
        md = gf.metadata
        kind = md.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{gf.path}: GGUF tokenizer model {kind!r} is not supported (only byte-level "
                "BPE, 'gpt2'); use a Hugging Face directory with tokenizer.json instead"
            )
        tokens: list[str] = md["tokenizer.ggml.tokens"]
        types: list[int] = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges: list[str] = md.get("tokenizer.ggml.merges") or []

        alphabet = set(_bytes_to_unicode().values())
        spell = _bytes_to_unicode()
        vocab: dict[str, int] = {}
        special: list[AddedToken] = []
        user: list[AddedToken] = []
        for i, (tok, ttype) in enumerate(zip(tokens, types, strict=False)):
            if ttype == TOKEN_TYPE_CONTROL:
                special.append(AddedToken(tok, special=True, normalized=False))
            elif ttype == TOKEN_TYPE_USER_DEFINED:
                user.append(AddedToken(tok, special=False, normalized=False))
            elif not set(tok) <= alphabet:
                # A plain token written as raw text: respell it in the byte alphabet.
                tok = "".join(spell[b] for b in tok.encode("utf-8"))
            vocab.setdefault(tok, i)
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]

        raw = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False))
        raw.pre_tokenizer = _byte_level_pre_tokenizer(md.get("tokenizer.ggml.pre"))
        raw.decoder = decoders.ByteLevel()
        if special:
            raw.add_special_tokens(special)
        if user:
            raw.add_tokens(user)

        def tok_at(key: str) -> str | None:
            idx = md.get(f"tokenizer.ggml.{key}")
            return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

        bos = tok_at("bos_token_id")
        add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False))
        if add_bos and bos is not None:
            raw.post_processor = _bos_processor(bos, md["tokenizer.ggml.bos_token_id"])
        return cls(
            raw,
            chat_template=md.get("tokenizer.chat_template"),
            bos_token=bos,
            eos_token=tok_at("eos_token_id"),
            eos_token_ids=gguf_eos_token_ids(md),
            add_bos_token=add_bos,
            source=str(gf.path),
        )

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json, with tokenizer_config.json (special tokens, chat template)."""
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json")
        raw = tokenizers.Tokenizer.from_file(str(tok_file))
        tcfg = _read_json(model_dir / "tokenizer_config.json")

        template = tcfg.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        elif template is None:
            template = _read_json(model_dir / "chat_template.json").get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)

        bos = _token_content(tcfg.get("bos_token"))
        eos = _token_content(tcfg.get("eos_token"))
        eos_ids: list[int] = []
        for extra in ("generation_config.json", "config.json"):
            eos_ids += _eos_list(_read_json(model_dir / extra).get("eos_token_id"))
        im_end = raw.token_to_id("<|im_end|>")
        if im_end is not None and template and "<|im_end|>" in template:
            added = raw.get_added_tokens_decoder().get(im_end)
            if added is not None and added.special:
                eos_ids.append(im_end)

        add_bos = tcfg.get("add_bos_token")
        bos_id = raw.token_to_id(bos) if bos is not None else None
        if add_bos and bos_id is not None:
            probe = raw.encode("", add_special_tokens=True).ids
            if bos_id not in probe[:1]:
                raw.post_processor = _bos_processor(bos, bos_id)
        if add_bos is None and bos_id is not None:
            add_bos = raw.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(
            raw,
            chat_template=template,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=eos_ids,
            add_bos_token=bool(add_bos),
            source=str(model_dir),
        )

    # ---------------------------------------------------------------- encoding
    @property
    def raw(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._raw

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS is prepended only if the model asks for it."""
        return self._raw.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = False,
    ) -> str:
        """The text of `ids`. With special tokens shown and spaces_between_special_tokens,
        each special token is set apart by a space from the text and tokens beside it, as
        SGLang's sampling parameter of that name asks (Hugging Face's slow tokenizers'
        rule: the runs between special tokens decode on their own)."""
        ids = list(ids)
        specials = self.special_ids
        if skip_special_tokens or not spaces_between_special_tokens or specials.isdisjoint(ids):
            return self._raw.decode(ids, skip_special_tokens=skip_special_tokens)
        pieces: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id in specials:
                if run:
                    pieces.append(self._raw.decode(run, skip_special_tokens=False))
                    run = []
                pieces.append(self._raw.decode([token_id], skip_special_tokens=False))
            else:
                run.append(token_id)
        if run:
            pieces.append(self._raw.decode(run, skip_special_tokens=False))
        return " ".join(pieces)

    def id_to_token(self, i: int) -> str | None:
        return self._raw.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self._raw.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._raw.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @cached_property
    def pieces(self) -> tuple[str | None, ...] | None:
        """Each id's own text, where the text of any ids is the join of theirs and of
        whatever came before them (a byte-level BPE decoder joins their bytes): None for an
        id whose text is not whole characters, or an added or special token, which a
        decoder may treat apart. None in place of the table for other decoders."""
        raw = self._raw
        if not isinstance(raw.decoder, decoders.ByteLevel):
            return None
        added = raw.get_added_tokens_decoder()
        size = raw.get_vocab_size(with_added_tokens=True)
        pieces: list[str | None] = []
        for start in range(0, size, 4096):  # a slice at a time: a small peak of memory
            texts = raw.decode_batch([[i] for i in range(start, min(start + 4096, size))],
                                     skip_special_tokens=False)
            pieces += (None if start + k in added or not text or REPLACEMENT_CHAR in text
                       else text for k, text in enumerate(texts))
        return tuple(pieces)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._raw.get_added_tokens_decoder().items() if t.special)

    # ------------------------------------------------------------ chat template
    @cached_property
    def _compiled_template(self) -> Any:
        if not self.chat_template:
            raise ValueError(f"{self.source or 'this tokenizer'} has no chat template")
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the model's chat template (Jinja, sandboxed) to a prompt string."""
        if not isinstance(messages, list):
            raise ValueError("messages must be a list of {'role', 'content'} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ValueError(f"message {i} is not an object")
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} needs string 'role' and 'content' fields")
        return self._compiled_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size})"
