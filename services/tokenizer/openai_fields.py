"""Typed reads of a JSON request body's optional fields; a bad one raises OpenAIError.

A field set to null reads as absent, as OpenAI treats it."""

from __future__ import annotations

import math
from typing import Any

from radixmesh.services.tokenizer.openai_errors import OpenAIError


def is_int(value: object) -> bool:
    """True for JSON integers (bool is an int subclass in Python, not in JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(name: str, value: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and maximum is not None and not minimum <= value <= maximum:
        raise OpenAIError(f"{name} must be between {minimum} and {maximum}, got {value}", name)
    if minimum is not None and value < minimum:
        raise OpenAIError(f"{name} must be >= {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise OpenAIError(f"{name} must be <= {maximum}, got {value}", name)


def get_int(
    body: dict[str, Any], name: str, minimum: int | None = None, maximum: int | None = None
) -> int | None:
    """An optional integer field within [minimum, maximum]."""
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise OpenAIError(f"{name} must be an integer, got {value!r}", name)
    _check_range(name, value, minimum, maximum)
    return value


def get_number(
    body: dict[str, Any], name: str, minimum: float | None = None, maximum: float | None = None
) -> float | None:
    """An optional finite number field within [minimum, maximum], as a float."""
    value = body.get(name)
    if value is None:
        return None
    if not (is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise OpenAIError(f"{name} must be a number, got {value!r}", name)
    _check_range(name, value, minimum, maximum)
    return float(value)


def get_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """An optional boolean field."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"{name} must be a boolean, got {value!r}", name)
    return value


def get_str(body: dict[str, Any], name: str) -> str | None:
    """An optional string field."""
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise OpenAIError(f"{name} must be a string, got {value!r}", name)
    return value


def get_object(body: dict[str, Any], name: str) -> dict[str, Any]:
    """An optional JSON object field; absent reads as {}."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise OpenAIError(f"{name} must be an object, got {value!r}", name)
    return value
