"""A small frontend language for LLM programs, after SGLang's: a program is a Python
function over a prompt state, built with `+=` from text, role messages, `gen` and
`select`, that forks into branches sharing its prefix (the radix cache serves the shared
part once) and running at the same time.

    from radixmesh import lang

    @lang.function
    def review(s, topic):
        s += lang.user(f"Write one line about {topic}.")
        s += lang.assistant(lang.gen("line", max_tokens=24, stop="\\n"))
        s += lang.user("Is it positive?")
        s += lang.assistant(lang.select("mood", ["yes", "no"]))

    state = review.run(lang.EngineBackend(engine), topic="tea")
    state["line"], state["mood"], state.text()

Backends: EngineBackend (an in-process radixmesh.Engine), HttpBackend (a running mesh's
native /generate) and GrpcBackend (its gRPC Generate). Role messages render with the
served model's chat template. `+=` queues a call on the state's own thread; reading the
state waits for it. `run(..., stream=True)` returns at once and `state.text_iter()` yields
the text as it is generated; run_batch runs programs at the same time."""

from radixmesh.lang.backends import Answer, Backend, Chunk, EngineBackend, GrpcBackend, HttpBackend
from radixmesh.lang.chat import ChatTemplate
from radixmesh.lang.program import (
    Gen,
    RoleMark,
    Seq,
    Tools,
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    role,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from radixmesh.lang.state import Forks, Function, State, function

__all__ = [
    "Answer",
    "Backend",
    "ChatTemplate",
    "Chunk",
    "EngineBackend",
    "Forks",
    "Function",
    "Gen",
    "GrpcBackend",
    "HttpBackend",
    "RoleMark",
    "Seq",
    "State",
    "Tools",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "role",
    "select",
    "system",
    "system_begin",
    "system_end",
    "user",
    "user_begin",
    "user_end",
]
