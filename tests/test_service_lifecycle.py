"""What every service's main does around its start-up (radixmesh.mesh.service)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from radixmesh.mesh.service import YOUNG_GC_THRESHOLD, run_until_stopped


@pytest.fixture
def collector() -> Iterator[None]:
    """This process's collector as it was, after the test."""
    threshold = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_a_started_service_settles_its_heap(collector: None) -> None:
    """Once started, what start-up made leaves the collector's sight and the youngest
    generation waits for YOUNG_GC_THRESHOLD net allocations."""
    made: list[object] = []

    async def start() -> None:
        made.append({"start-up": [1, 2, 3]})

    assert asyncio.run(run_until_stopped(start(), asyncio.Event()))
    assert gc.get_threshold()[0] == YOUNG_GC_THRESHOLD
    assert gc.get_freeze_count() > 0
    assert gc.is_tracked(made[0]) and all(o is not made[0] for o in gc.get_objects())


def test_a_service_stopped_before_it_started_leaves_the_collector_alone(
        collector: None) -> None:
    async def main() -> bool:
        stop = asyncio.Event()
        stop.set()
        return await run_until_stopped(asyncio.Event().wait(), stop)

    before = gc.get_threshold()
    assert not asyncio.run(main())
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
