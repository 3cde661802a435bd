"""What the in-process Engine's end-to-end tests share besides their engines (the `engine`
and `chunked` fixtures of conftest.py): small checks around them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from radixmesh.api import Engine

GREEDY = {"temperature": 0}
Result = dict[str, Any]


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
