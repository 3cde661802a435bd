"""The sampling fields of an OpenAI request (and SGLang's extras) as SamplingParams."""

from __future__ import annotations

from typing import Any

from radixmesh.core.sampling_params import SamplingParams
from radixmesh.services.tokenizer.openai_errors import OpenAIError
from radixmesh.services.tokenizer.openai_fields import get_int, get_number

# SGLang's sampling fields, accepted as they are (SamplingParams checks them).
_PASSTHROUGH = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "stop_token_ids",
)


def sampling_params(
    body: dict[str, Any], max_tokens: int, max_param: str, vocab_size: int
) -> SamplingParams:
    """The sampling fields of a request (OpenAI's and SGLang's) as SamplingParams."""
    fields: dict[str, Any] = {"max_new_tokens": max_tokens}
    optional = {
        "temperature": get_number(body, "temperature", 0, 2),
        "top_p": get_number(body, "top_p", 0, 1),
        "presence_penalty": get_number(body, "presence_penalty", -2, 2),
        "frequency_penalty": get_number(body, "frequency_penalty", -2, 2),
        "min_new_tokens": get_int(body, "min_tokens", minimum=0),
        "seed": get_int(body, "seed"),
        "stop": body.get("stop"),
        **{name: body.get(name) for name in _PASSTHROUGH},
    }
    fields.update({name: value for name, value in optional.items() if value is not None})
    try:
        params = SamplingParams.from_dict(fields)
        params.validate(vocab_size or None)
    except ValueError as exc:
        # SamplingParams names the field first; speak of it by the request's name for it.
        renames = {"max_new_tokens": max_param, "min_new_tokens": "min_tokens"}
        message = str(exc)
        for ours, theirs in renames.items():
            message = message.replace(ours, theirs)
        raise OpenAIError(message, message.split(" ", 1)[0]) from None
    return params
