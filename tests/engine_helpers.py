"""What the in-process Engine's end-to-end tests share: the bundled model in float32, once
with the default prefill and once in chunks of 4 tokens, and small checks around them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from radixmesh.api import Engine

GREEDY = {"temperature": 0}
Result = dict[str, Any]


def float32_engine() -> Iterator[Engine]:
    """The engine most tests share (so its prefix cache carries over between them)."""
    eng = Engine(dtype="float32", max_total_tokens=8192, show_progress=False, random_seed=0)
    yield eng
    eng.shutdown()


def chunked_engine() -> Iterator[Engine]:
    """Prompts prefilled 4 tokens per step, so every prompt spans several chunks."""
    eng = Engine(
        dtype="float32",
        max_total_tokens=2048,
        chunked_prefill_size=4,
        show_progress=False,
        random_seed=0,
    )
    yield eng
    eng.shutdown()


def one(engine: Engine, prompt: str, params: dict[str, Any], **kw: Any) -> Result:
    out = engine.generate(prompt, params, **kw)
    assert isinstance(out, dict)
    return out


def assert_nothing_held(engine: Engine) -> dict[str, Any]:
    info = engine.server_info()
    assert info["held_slots"] == 0, info
    assert info["running"] == 0 and info["waiting"] == 0, info
    assert info["free_slots"] + info["cached_tokens"] == info["num_slots"], info
    return info


def in_thread(fn: Callable[..., Any], *args: Any, **kw: Any) -> Future[Any]:
    """Run fn on a daemon thread, so a regression that hangs it cannot hang the test run."""
    done: Future[Any] = Future()

    def target() -> None:
        try:
            done.set_result(fn(*args, **kw))
        except BaseException as exc:
            done.set_exception(exc)

    threading.Thread(target=target, daemon=True).start()
    return done
