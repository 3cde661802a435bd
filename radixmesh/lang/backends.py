"""Where a program's requests run: an in-process Engine, a mesh's native HTTP /generate,
or its public gRPC Generate. Each generates batches, streams one prompt's text as it comes,
and supplies the served model's chat template."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from radixmesh.lang.chat import ChatTemplate

if TYPE_CHECKING:
    import grpc

    from radixmesh.api import Engine
    from radixmesh.proto import generate_pb2 as gpb

Answer = tuple[str, dict[str, Any]]  # generated text and its meta_info
Chunk = tuple[str, dict[str, Any]]  # new text and the meta_info so far (final on the last)


def joined(chunks: Iterable[Chunk], each: Callable[[str], None] | None = None) -> Answer:
    """The whole text of a stream and its last meta_info; `each` sees every chunk."""
    text, meta = "", {}
    for delta, latest in chunks:
        text, meta = text + delta, latest
        if each is not None:
            each(delta)
    return text, meta


class Backend(Protocol):
    """Where a program's requests run."""

    def generate(self, texts: list[str], params: list[dict[str, Any]], **extra: Any
                 ) -> list[Answer]:
        """One batch of prompts; `extra` holds return_logprob and logprob_start_len."""

    def stream(self, text: str, params: dict[str, Any]) -> Iterator[Chunk]:
        """One prompt's output as it is generated."""

    def chat_template(self) -> ChatTemplate:
        """The served model's chat template, for role messages."""


class EngineBackend:
    """An in-process Engine; every request runs with LoRA adapter `lora_path`, if given."""

    def __init__(self, engine: Engine, lora_path: str | None = None) -> None:
        self.engine = engine
        self.lora_path = lora_path

    def generate(self, texts: list[str], params: list[dict[str, Any]], **extra: Any
                 ) -> list[Answer]:
        outs = self.engine.generate(texts, params, lora_path=self.lora_path, **extra)
        return [(o["text"], o["meta_info"]) for o in outs]

    def stream(self, text: str, params: dict[str, Any]) -> Iterator[Chunk]:
        for chunk in self.engine.generate(text, params, stream=True, lora_path=self.lora_path):
            yield chunk["text"], chunk["meta_info"]

    def chat_template(self) -> ChatTemplate:
        return ChatTemplate.from_tokenizer(self.engine.tokenizer)


class HttpBackend:
    """A running mesh, through its native /generate; roles use the template its
    /get_model_info serves (or `chat_template`, for a server that serves none). Every
    request runs with LoRA adapter `lora_path`, if given."""

    def __init__(self, url: str, timeout: float = 300.0, api_key: str = "",
                 chat_template: ChatTemplate | None = None, lora_path: str | None = None
                 ) -> None:
        self._lora = {"lora_path": lora_path} if lora_path else {}
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key
        self._template = chat_template
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def generate(self, texts: list[str], params: list[dict[str, Any]], **extra: Any
                 ) -> list[Answer]:
        body = {"text": texts, "sampling_params": params, **self._lora, **extra}
        with self._post(body) as reply:
            outs = json.loads(reply.read())
        return [(o["text"], o["meta_info"]) for o in outs]

    def stream(self, text: str, params: dict[str, Any]) -> Iterator[Chunk]:
        seen = 0
        with self._post({"text": text, "sampling_params": params, "stream": True,
                         **self._lora}) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise ValueError(f"/generate failed: {event['error']['message']}")
                # Each event carries the whole text so far, as SGLang's does.
                yield event["text"][seen:], event["meta_info"]
                seen = len(event["text"])

    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate.from_server(self.url, self.api_key, self.timeout)
        return self._template

    def _post(self, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(self.url + "/generate", json.dumps(body).encode(),
                                         self._headers)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            raise ValueError(f"/generate answered {exc.code}: {exc.read().decode()}") from None


class GrpcBackend:
    """A running mesh, through its public gRPC Generate (`target` is host:port). That
    API only generates: roles need `chat_template` (ChatTemplate.from_server(http_url) or
    ChatTemplate.from_model(path)). Every request runs with LoRA adapter `lora_path`, if
    given."""

    def __init__(self, target: str, timeout: float = 300.0, api_key: str = "",
                 chat_template: ChatTemplate | None = None, lora_path: str | None = None
                 ) -> None:
        self.lora_path = lora_path or ""
        self.target = target
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._template = chat_template

    def generate(self, texts: list[str], params: list[dict[str, Any]], **extra: Any
                 ) -> list[Answer]:
        # Start every call before reading any, so the engine batches them.
        calls = [self._call(t, p, **extra) for t, p in zip(texts, params, strict=True)]
        return [joined(self._read(call)) for call in calls]

    def stream(self, text: str, params: dict[str, Any]) -> Iterator[Chunk]:
        yield from self._read(self._call(text, params))

    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            raise ValueError("the gRPC Generate API serves no chat template: give "
                             "GrpcBackend chat_template=ChatTemplate.from_server(http_url)")
        return self._template

    @cached_property
    def _stub(self) -> Any:
        import grpc

        from radixmesh.proto import generate_pb2_grpc as ggrpc

        return ggrpc.GenerateStub(grpc.insecure_channel(self.target))

    def _call(self, text: str, params: dict[str, Any], return_logprob: bool = False,
              logprob_start_len: int = -1) -> Iterator[gpb.GenerateResponse]:
        from radixmesh.proto import generate_pb2 as gpb

        fields = gpb.ClientSamplingParams.DESCRIPTOR.fields_by_name
        unknown = sorted(set(params) - set(fields))
        if unknown:
            raise ValueError(f"the gRPC Generate API has no sampling field {unknown[0]}")
        request = gpb.GenerateRequest(
            text=text, sampling_params=gpb.ClientSamplingParams(**params),
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            lora_path=self.lora_path,
        )
        return self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)

    def _read(self, call: Iterator[gpb.GenerateResponse]) -> Iterator[Chunk]:
        import grpc

        meta: dict[str, Any] = {"input_token_logprobs": [], "output_token_logprobs": []}
        try:
            for response in call:
                meta = _meta(response, meta)
                yield response.text, meta
        except grpc.RpcError as exc:
            raise _grpc_error(exc) from None


def _meta(response: gpb.GenerateResponse, before: dict[str, Any]) -> dict[str, Any]:
    """meta_info as /generate answers it, from a response and the meta before it."""
    def entries(items: Any) -> list[tuple[float | None, int, None]]:
        return [(e.logprob if e.has_logprob else None, e.token_id, None) for e in items]

    finish = None
    if response.HasField("finish"):
        finish = {"type": response.finish.kind}
        matched = response.finish.WhichOneof("matched")
        if matched is not None:
            finish["length" if finish["type"] == "length" else "matched"] = getattr(
                response.finish, matched)
    return {
        "id": response.rid,
        "finish_reason": finish,
        "prompt_tokens": response.prompt_tokens,
        "completion_tokens": response.completion_tokens,
        "cached_tokens": response.cached_tokens,
        # The prompt's logprobs come whole with the last response.
        "input_token_logprobs": (entries(response.input_token_logprobs)
                                 or before["input_token_logprobs"]),
        "output_token_logprobs": [*before["output_token_logprobs"],
                                  *entries(response.output_token_logprobs)],
    }


def _grpc_error(exc: grpc.RpcError) -> Exception:
    import grpc

    code, details = exc.code(), exc.details()
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(details)
    return RuntimeError(f"gRPC Generate failed: {code.name}: {details}")
