"""Chat messages as OpenAI clients send them, reduced to what a chat template renders."""

from __future__ import annotations

from typing import Any

from radixmesh.services.tokenizer.openai_errors import OpenAIError

# OpenAI's newer "developer" role is its name for the system prompt.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_messages(raw: Any) -> list[dict[str, str]]:
    """Check `messages` and return them as plain {"role", "content"} dicts with text content."""
    if not isinstance(raw, list):
        raise OpenAIError(f"messages must be a list of messages, got {raw!r}", "messages")
    if not raw:
        raise OpenAIError("messages must not be empty", "messages")
    return [_message(i, message) for i, message in enumerate(raw)]


def _message(i: int, message: Any) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise OpenAIError(f"{where} must be an object, got {message!r}", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise OpenAIError(
            f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}", f"{where}.role"
        )
    return {"role": _ROLES[role], "content": _content(message.get("content"), role, where)}


def _content(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    # An assistant turn that only called tools has null content.
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise OpenAIError(
            f"{where}.content must be a string or a list of text parts, got {content!r}",
            f"{where}.content",
        )
    texts = []
    for part in content:
        if not (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            raise OpenAIError(
                f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are "
                f"supported, got {part!r}",
                f"{where}.content",
            )
        texts.append(part["text"])
    # Parts are separate blocks to the client; a newline keeps their words apart.
    return "\n".join(texts)
