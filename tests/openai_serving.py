"""The OpenAI routes on a real aiohttp server over a fake mesh (fake_generation.py), and the
openai client's scenarios run against them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from fake_generation import (
    REPLY,
    FakeGenerationClient,
)
from openai import AsyncOpenAI

from radixmesh.core.tokenizer import Tokenizer
from radixmesh.services.tokenizer.openai_api import add_openai_routes

MODEL = "fake/SmolLM2"
USER = [{"role": "user", "content": "What is the answer?"}]
PROMPT = "The question is"
Scenario = Callable[[AsyncOpenAI, FakeGenerationClient], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(
    fake: FakeGenerationClient, handler_cancellation: bool = False, **parsers: str
) -> AsyncIterator[str]:
    """The routes on a free loopback port, with the chat parsers named; yields the API's
    base URL."""
    app = web.Application()
    add_openai_routes(app, fake, **parsers)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=handler_cancellation)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


def run(
    tok: Tokenizer, scenario: Scenario, handler_cancellation: bool = False, **parsers: str
) -> FakeGenerationClient:
    """Serve a fresh fake mesh (with the chat parsers named), run `scenario` against it,
    return the fake for checks."""
    fake = FakeGenerationClient(tok, MODEL)

    async def main() -> None:
        async with serving(fake, handler_cancellation, **parsers) as base_url:
            api = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
            try:
                await scenario(api, fake)
            finally:
                await api.close()

    asyncio.run(main())
    return fake


def reply_ids(tok: Tokenizer) -> list[int]:
    return tok.encode(REPLY)


def chat_ids(tok: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
