"""HTTP clients of the servers under test: radixmesh's /generate and OpenAI /v1/completions.

Both stream, ask for exactly the requested output length (ignore_eos plus the minimum and
maximum token counts) and greedy decoding, so every engine does the same work."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from radixmesh.bench.streams import NativeStream, OpenAIStream, StreamError, TokenClock, sse_payload
from radixmesh.core.tokenizer import Tokenizer

PromptFormat = Literal["ids", "text"]
_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=900)


@dataclass
class Completion:
    """One finished (or failed) request: what it measured and the ids it produced."""

    clock: TokenClock
    latency: float = 0.0
    output_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cached_tokens_details: dict[str, int] | None = None  # cached_tokens per tier, when split
    error: str | None = None


class Backend(ABC):
    """A server under test, reached over one shared HTTP session."""

    name: str

    def __init__(self, base_url: str, tokenizer: Tokenizer, keep_alive: bool = True) -> None:
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        # Off for servers that drop idle connections without a word (llama-server): a
        # request sent on one of those fails.
        self.keep_alive = keep_alive
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # The runner bounds concurrency itself.
            connector = aiohttp.TCPConnector(limit=0, force_close=not self.keep_alive)
            self._session = aiohttp.ClientSession(timeout=_TIMEOUT, connector=connector)
        return self._session

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def flush_cache(self) -> bool:
        """Ask the server to drop its prefix cache; False where it has no such route."""
        try:
            async with self.session.post(self.base_url + "/flush_cache") as resp:
                return resp.status == 200
        except aiohttp.ClientError:
            return False

    async def complete(self, prompt: list[int], output_len: int) -> Completion:
        """Send one prompt, stream its answer, time every token."""
        clock = TokenClock(time.perf_counter())
        try:
            done = await self._stream(prompt, output_len, clock)
        except (aiohttp.ClientError, StreamError, ValueError, TimeoutError) as exc:
            done = Completion(clock, error=f"{type(exc).__name__}: {exc}"[:500])
        done.latency = time.perf_counter() - clock.started
        return done

    async def _post_stream(
        self, path: str, body: dict[str, Any], feed: NativeStream | OpenAIStream
    ) -> None:
        async with self.session.post(self.base_url + path, json=body) as resp:
            if resp.status != 200:
                raise StreamError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for raw in resp.content:
                payload = sse_payload(raw.decode("utf-8"))
                if payload is not None:
                    feed.feed(payload, time.perf_counter())
        feed.check_finished()

    @abstractmethod
    async def _stream(self, prompt: list[int], output_len: int, clock: TokenClock) -> Completion:
        """Run one request, feeding the clock as tokens arrive."""


class RadixmeshBackend(Backend):
    """radixmesh's (and SGLang's) native POST /generate, prompts as input_ids."""

    name = "radixmesh"

    async def _stream(self, prompt: list[int], output_len: int, clock: TokenClock) -> Completion:
        body = {
            "input_ids": prompt,
            "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "min_new_tokens": output_len,
                                "ignore_eos": True, "temperature": 0.0},
        }
        stream = NativeStream(clock)
        await self._post_stream("/generate", body, stream)
        return Completion(clock, output_tokens=stream.completion_tokens,
                          output_ids=stream.output_ids, prompt_tokens=stream.prompt_tokens,
                          cached_tokens=stream.cached_tokens,
                          cached_tokens_details=stream.cached_tokens_details)


class OpenAIBackend(Backend):
    """Any OpenAI-compatible POST /v1/completions; prompts as token ids or as their text."""

    name = "openai"

    def __init__(
        self, base_url: str, tokenizer: Tokenizer, model: str | None = None,
        prompt_format: PromptFormat = "ids", extra_body: dict[str, Any] | None = None,
        keep_alive: bool = True,
    ) -> None:
        super().__init__(base_url, tokenizer, keep_alive)
        self.model = model
        self.prompt_format = prompt_format
        self.extra_body = extra_body or {}

    async def resolve_model(self) -> str:
        """The model to name in requests: the one given, else the server's first."""
        if self.model is None:
            async with self.session.get(self.base_url + "/v1/models") as resp:
                resp.raise_for_status()
                self.model = str((await resp.json())["data"][0]["id"])
        return self.model

    async def _stream(self, prompt: list[int], output_len: int, clock: TokenClock) -> Completion:
        body: dict[str, Any] = {
            "model": await self.resolve_model(),
            "prompt": prompt if self.prompt_format == "ids" else self.tokenizer.decode(prompt),
            "max_tokens": output_len,
            "min_tokens": output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra_body,
        }
        stream = OpenAIStream(clock, output_len)
        await self._post_stream("/v1/completions", body, stream)
        ids = self.tokenizer.encode(stream.text, add_special_tokens=False)
        return Completion(clock, output_tokens=stream.output_tokens, output_ids=ids,
                          prompt_tokens=stream.prompt_tokens, cached_tokens=stream.cached_tokens)
