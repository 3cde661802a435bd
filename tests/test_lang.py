"""The frontend language on the real model (float32), on the in-process Engine and on a
running mesh over HTTP: gen with a regex, select, fork sharing a prefix, run_batch."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from process_helpers import running_mesh

from radixmesh import lang
from radixmesh.api import Engine

PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@lang.function
def pizza(s, place):
    s += f"The phone number of {place} is " + lang.gen("phone", max_tokens=20, regex=PHONE)
    s += ". The capital of France is"
    s += lang.select("capital", [" Paris", " London", " banana"])


@lang.function
def two_ideas(s, topic):
    s += f"Here is a long list of ideas about {topic}, one per line, each different.\n" * 8
    branches = s.fork(2)
    for i, branch in enumerate(branches):
        branch += f"Idea {i + 1}:"
        branch += lang.gen(f"idea{i}", max_tokens=8, stop="\n")
    s.join(branches)


@pytest.fixture(scope="module", params=["engine", "mesh"])
def backend(request, tmp_path_factory) -> Iterator[lang.Backend]:
    if request.param == "engine":
        with Engine(dtype="float32", show_progress=False, max_total_tokens=8192) as engine:
            yield lang.EngineBackend(engine)
    else:
        with running_mesh(tmp_path_factory.mktemp("lang"), dtype="float32",
                          max_total_tokens=8192) as mesh:
            yield lang.HttpBackend(mesh.url)


def test_gen_with_a_regex_and_select(backend):
    state = pizza.run(backend, place="Luigi's")
    assert re.fullmatch(PHONE, state["phone"])
    assert state["capital"] == " Paris"
    paris, london, banana = state.scores["capital"]
    assert paris > london > banana
    assert state.text().endswith(f"{state['phone']}. The capital of France is Paris")


def test_forks_share_their_prefix(backend):
    state = two_ideas.run(backend, topic="gardens")
    assert set(state.variables) == {"idea0", "idea1"}
    prompt_len = state.meta["idea1"]["prompt_tokens"]
    # The second branch finds the shared prefix cached by the first.
    assert state.meta["idea1"]["cached_tokens"] >= prompt_len - 8


def test_run_batch_keeps_the_order(backend):
    places = ["Luigi's", "Mario's", "Gino's"]
    states = pizza.run_batch([{"place": p} for p in places], backend)
    assert [s.text().split(" is ")[0] for s in states] == [
        f"The phone number of {p}" for p in places
    ]
    singles = [pizza.run(backend, place=p)["phone"] for p in places]
    assert [s["phone"] for s in states] == singles


def test_a_bad_constraint_surfaces_as_an_error(backend):
    @lang.function
    def bad(s):
        s += "x"
        s += lang.gen("y", regex="(unclosed")

    with pytest.raises(ValueError, match="invalid regex"):
        bad.run(backend)
