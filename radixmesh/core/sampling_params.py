"""What a request asks of generation: sampling parameters (SGLang's names and defaults) and
the logprobs it wants back."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = (
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
)
# OpenAI's bounds: -100 bans a token and +100 all but forces it.
MAX_LOGIT_BIAS = 100.0
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")  # SGLang's names
# Other names a request may give a field by: SGLang's per-request seed is sampling_seed.
ALIASES = {"sampling_seed": "seed"}


def _is_int(value: object) -> bool:
    """True for ints but not bools (bool subclasses int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """True for finite ints and floats, but not bools."""
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 disables it
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # With special tokens shown, a space sets each apart from the text around it.
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # Added to a token's logit before penalties and masks: token id -> bias.
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    # At most one constraint on the output: a JSON schema (as JSON text), a regex, an EBNF
    # grammar, or a structural tag (JSON: free text with constrained parts, xgrammar's
    # format; radixmesh.core.grammar checks them).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def checked(cls, **values: Any) -> SamplingParams:
        """Params a front door already checked, rebuilt on the far side of a hop: taken as
        they are, not checked again (fields not given keep their defaults)."""
        params = cls.__new__(cls)
        for f in fields(cls):
            if f.name in values:
                value = values[f.name]
            else:
                value = f.default_factory() if f.default is MISSING else f.default
            object.__setattr__(params, f.name, value)
        return params

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a user-supplied dictionary, rejecting unknown keys and bad values; a
        field may be given by its alias (ALIASES), but not by both names with two values."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling params must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)} | set(ALIASES)
        for key in d:
            if key not in known:
                raise ValueError(f"unknown sampling parameter {key!r}")
        kwargs = dict(d)
        for alias, name in ALIASES.items():
            if alias not in kwargs:
                continue
            value = kwargs.pop(alias)
            if name in kwargs and kwargs[name] != value:
                raise ValueError(f"{alias} ({value!r}) and {name} ({kwargs[name]!r}) are one "
                                 "parameter under two names: give one, or the same value")
            kwargs[name] = value
        for name in ("stop", "stop_token_ids"):
            if name in kwargs:
                kwargs[name] = _as_list(kwargs[name])
        for name in _FLOAT_FIELDS:
            # JSON clients send 1 for 1.0; store floats so equal params compare equal.
            if name in kwargs and _is_int(kwargs[name]):
                kwargs[name] = float(kwargs[name])
        if "logit_bias" in kwargs:
            kwargs["logit_bias"] = _as_bias(kwargs["logit_bias"])
        return cls(**kwargs)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """The output's constraint as (kind, text), if it has one."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def is_greedy(self) -> bool:
        """Whether sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field with a bad type or value."""
        self._check_types()
        checks = (
            ("max_new_tokens", self.max_new_tokens >= 0, ">= 0"),
            (
                "min_new_tokens",
                0 <= self.min_new_tokens <= self.max_new_tokens,
                f">= 0 and <= max_new_tokens ({self.max_new_tokens})",
            ),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= -1, "-1, 0 or >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")
        for token_id in self.stop_token_ids:
            if (bound := _vocab_bound(token_id, vocab_size)) is not None:
                raise ValueError(f"stop_token_ids entries must be >= 0{bound}, got {token_id!r}")
        for token_id, bias in self.logit_bias.items():
            if (bound := _vocab_bound(token_id, vocab_size)) is not None:
                raise ValueError(f"logit_bias keys must be token ids >= 0{bound}, got {token_id}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}"
                )

    def _check_types(self) -> None:
        """Raise ValueError naming the first field whose value has the wrong type."""
        for name in _INT_FIELDS:
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in _FLOAT_FIELDS:
            if not _is_number(getattr(self, name)):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(
                f"stop must be a non-empty string or a list of them, got {self.stop!r}"
            )
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) for t in self.stop_token_ids
        ):
            ids = self.stop_token_ids
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
        if not isinstance(self.logit_bias, dict) or not all(
            _is_int(t) and _is_number(b) for t, b in self.logit_bias.items()
        ):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or null, got {self.seed!r}")
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        for kind in given:
            if not isinstance(getattr(self, kind), str) or not getattr(self, kind):
                raise ValueError(f"{kind} must be a non-empty string, got {getattr(self, kind)!r}")
        if len(given) > 1:
            raise ValueError(f"at most one of {', '.join(GRAMMAR_KINDS)}, got {', '.join(given)}")


def _vocab_bound(token_id: int, vocab_size: int | None) -> str | None:
    """None for a token id inside the vocabulary; else the upper bound it may break, as
    error messages word it ("" while the vocabulary size is unknown)."""
    if token_id >= 0 and (vocab_size is None or token_id < vocab_size):
        return None
    return "" if vocab_size is None else f" and < vocab size {vocab_size}"


def _as_list(value: object) -> object:
    """Accept null, a lone string or a tuple for a list field; leave the rest to validation."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, tuple):
        return list(value)
    return value


def _as_bias(value: object) -> object:
    """Accept null for no bias, and JSON's string keys ("50256") for token ids; store int
    keys and float biases so equal params compare equal. The rest is left to validation."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        return value
    out: dict[object, object] = {}
    for key, bias in value.items():
        if isinstance(key, str):
            try:
                key = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        out[key] = float(bias) if _is_int(bias) else bias
    return out


@dataclass(frozen=True)
class LogprobRequest:
    """Which logprobs a request wants back."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # first prompt position whose token logprob is wanted; -1: none
