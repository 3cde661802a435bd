"""The whole mesh as real processes (NATS, worker, scheduler, detokenizer, tokenizer) on
the real SmolLM2, called through its front doors the way users call it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from process_helpers import running_mesh

from radixmesh import lang
from radixmesh.api import Engine
from radixmesh.launcher import Mesh
from radixmesh.proto import generate_pb2 as gpb
from radixmesh.proto import generate_pb2_grpc as ggrpc

GREEDY = {"temperature": 0, "max_new_tokens": 16}
# SmolLM2 is a dense Llama.
SMOLLM2_SHAPE = {"architecture": "llama", "num_experts": 0, "num_experts_per_tok": 0}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[Mesh]:
    """The mesh drafts n-grams, so every test here also checks that speculation changes
    nothing a client sees (the in-process engine it is compared with does not draft)."""
    log_dir = tmp_path_factory.mktemp("mesh-logs")
    with running_mesh(log_dir, dtype="float32", max_total_tokens=8192,
                      speculative_algorithm="NGRAM") as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=mesh.url, timeout=120) as c:
        yield c


def engine_info(client: httpx.Client) -> dict:
    states = client.get("/server_info").json()["internal_states"]
    assert len(states) == 1
    return states[0]


def wait_idle(client: httpx.Client, timeout: float = 30) -> dict:
    """Engine info once nothing runs and no request holds KV slots."""
    deadline = time.monotonic() + timeout
    while True:
        info = engine_info(client)
        if info["running"] == 0 and info["waiting"] == 0 and info["held_slots"] == 0:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.1)


def sse_events(response: httpx.Response) -> list[dict]:
    """Every `data:` payload of an SSE stream; the stream must end with [DONE]."""
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(dtype="float32", max_total_tokens=4096, show_progress=False) as e:
        yield e


def test_mesh_output_equals_in_process_engine(client, engine):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    expected = engine.generate(prompts, GREEDY)
    got = client.post("/generate", json={"text": prompts, "sampling_params": GREEDY}).json()
    for g, e in zip(got, expected, strict=True):
        assert g["output_ids"] == e["output_ids"]
        assert g["text"] == e["text"]
        assert g["meta_info"]["completion_tokens"] == 16
        assert g["meta_info"]["finish_reason"] == {"type": "length", "length": 16}


def test_model_and_server_info_name_the_architecture(client, engine):
    """Worker, scheduler heartbeat and tokenizer carry the model's shape to every answer
    that describes the model; the in-process engine answers as the mesh does."""
    model = client.get("/get_model_info").json()
    assert {k: model[k] for k in SMOLLM2_SHAPE} == SMOLLM2_SHAPE
    assert engine.model_info() == model
    server = client.get("/server_info").json()
    assert {k: server[k] for k in SMOLLM2_SHAPE} == SMOLLM2_SHAPE
    assert {k: engine_info(client)[k] for k in SMOLLM2_SHAPE} == SMOLLM2_SHAPE
    assert {k: engine.server_info()[k] for k in SMOLLM2_SHAPE} == SMOLLM2_SHAPE


def test_drafts_speed_up_copying_and_change_no_token(client, engine):
    """A prompt whose answer repeats it: the scheduler drafts from its n-gram store, the
    worker verifies, and the text is the in-process engine's without drafts."""
    text = "one two three four five six seven eight nine ten, " * 3
    body = {"text": f"Repeat: {text}", "sampling_params": {**GREEDY, "max_new_tokens": 48}}
    expected = engine.generate(body["text"], body["sampling_params"])
    got = client.post("/generate", json=body).json()
    assert got["output_ids"] == expected["output_ids"]
    meta = got["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accepted_tokens"] > 0
    assert meta["spec_accept_length"] > 1
    assert "spec_verify_ct" not in expected["meta_info"]  # no drafts, no figures
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1]["text"] == got["text"]
    # A verify step's tokens arrive together: fewer chunks than tokens.
    assert len(events) < 48
    info = wait_idle(client)
    assert info["spec_accepted_tokens"] >= 2 * meta["spec_accepted_tokens"]
    assert info["avg_spec_accept_length"] > 1


def test_native_generate_single_stream_logprobs_and_cache(client):
    body = {"text": "List three colors:", "sampling_params": GREEDY}
    first = client.post("/generate", json=body).json()
    meta = first["meta_info"]
    assert meta["prompt_tokens"] > 0 and meta["completion_tokens"] == 16
    assert set(meta) >= {"id", "prompt_tokens", "completion_tokens", "cached_tokens",
                         "cached_tokens_details", "finish_reason"}
    again = client.post("/generate", json=body).json()
    hit = meta["prompt_tokens"] - 1
    assert again["meta_info"]["cached_tokens"] == hit
    # Through scheduler, detokenizer and tokenizer: the device pool still holds it all.
    assert again["meta_info"]["cached_tokens_details"] == {"device": hit, "host": 0, "storage": 0}
    assert again["output_ids"] == first["output_ids"]

    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert events[-1]["text"] == first["text"]  # SGLang streams the text so far

    lp = client.post("/generate", json={
        **body, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
    }).json()["meta_info"]
    assert len(lp["output_token_logprobs"]) == 16
    assert [t[1] for t in lp["output_token_logprobs"]] == first["output_ids"]
    assert len(lp["input_token_logprobs"]) == meta["prompt_tokens"]
    assert lp["input_token_logprobs"][0][0] is None
    assert all(len(top) == 2 for top in lp["output_top_logprobs"])


def test_openai_chat_and_completions(mesh, client):
    oa = openai.OpenAI(base_url=mesh.url + "/v1", api_key="none")
    model = oa.models.list().data[0].id
    chat = oa.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12, temperature=0, n=2,
    )
    assert len(chat.choices) == 2
    assert chat.choices[0].message.content == chat.choices[1].message.content != ""
    assert chat.usage.completion_tokens <= 24
    streamed = oa.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0

    done = oa.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
    stop_at = done.choices[0].text.split(",")[1]
    stopped = oa.completions.create(
        model=model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stop=[stop_at],
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stop_at not in stopped.choices[0].text
    text = "".join(c.choices[0].text for c in oa.completions.create(
        model=model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stream=True))
    assert text == done.choices[0].text


def test_openai_chat_logit_bias_bans_and_forces(mesh, engine):
    oa = openai.OpenAI(base_url=mesh.url + "/v1", api_key="none")
    model = oa.models.list().data[0].id
    messages = [{"role": "user", "content": "Name a fruit."}]
    plain = oa.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                       temperature=0)
    first = engine.tokenizer.encode(plain.choices[0].message.content)[0]
    banned = oa.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                        temperature=0, logit_bias={str(first): -100})
    assert banned.choices[0].message.content != plain.choices[0].message.content
    assert first not in engine.tokenizer.encode(banned.choices[0].message.content)
    banana = engine.tokenizer.encode(" banana")[0]
    forced = oa.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                        seed=3, logit_bias={str(banana): 100})
    assert forced.choices[0].message.content.split() == ["banana"] * 4


def test_native_generate_n_samples_share_the_cached_prompt(client):
    prompt = "Write one short sentence about the sea, please, in plain words:"
    # Sampled, seeded (each sample takes the next seed), to their full length.
    body = {"text": prompt, "rid": "sea", "sampling_params": {
        "n": 2, "max_new_tokens": 8, "seed": 7, "ignore_eos": True}}
    got = client.post("/generate", json=body).json()
    assert [g["meta_info"]["id"] for g in got] == ["sea_0", "sea_1"]
    assert got[0]["output_ids"] != got[1]["output_ids"]
    for g in got:
        meta = g["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 8}
        assert meta["cached_tokens"] == meta["prompt_tokens"] - 1


def test_grpc_generate_streams(mesh):
    async def run() -> tuple[list[gpb.GenerateResponse], list[gpb.GenerateResponse]]:
        async with grpc.aio.insecure_channel(mesh.grpc_addrs[0]) as channel:
            stub = ggrpc.GenerateStub(channel)
            request = gpb.GenerateRequest(
                text="Count: one, two,",
                sampling_params=gpb.ClientSamplingParams(max_new_tokens=10, temperature=0),
            )
            first = [r async for r in stub.Generate(request)]
            return first, [r async for r in stub.Generate(request)]

    responses, again = asyncio.run(run())
    assert len(responses) > 1
    assert responses[-1].finish.kind == "length"
    assert sum(len(r.output_ids) for r in responses) == 10
    assert responses[-1].completion_tokens == 10
    hit = again[-1].prompt_tokens - 1
    assert again[-1].cached_tokens == hit
    assert again[-1].cached_tokens_details == gpb.CachedTokensDetails(device=hit)


def test_grpc_cancel_frees_slots(mesh, client):
    async def run() -> int:
        async with grpc.aio.insecure_channel(mesh.grpc_addrs[0]) as channel:
            stub = ggrpc.GenerateStub(channel)
            params = gpb.ClientSamplingParams(max_new_tokens=2000, ignore_eos=True)
            call = stub.Generate(gpb.GenerateRequest(text="Go on and on", sampling_params=params))
            seen = 0
            async for response in call:
                seen += len(response.output_ids)
                if seen >= 2:
                    call.cancel()
                    break
            return seen

    assert asyncio.run(run()) >= 2
    info = wait_idle(client, timeout=10)
    assert info["free_slots"] + info["cached_tokens"] == info["num_slots"]


def test_32_concurrent_streams_complete(mesh, client):
    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, int]:
        body = {"text": f"Story number {i}:", "stream": True,
                "sampling_params": {"max_new_tokens": 8 + i % 5, "ignore_eos": True}}
        ids = 0
        async with http.stream("POST", "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    ids = chunk["meta_info"]["completion_tokens"]
        return i, ids

    async def run() -> list[tuple[int, int]]:
        async with httpx.AsyncClient(base_url=mesh.url, timeout=300) as http:
            return await asyncio.gather(*(one(http, i) for i in range(32)))

    for i, n in asyncio.run(run()):
        assert n == 8 + i % 5
    wait_idle(client)


def test_client_disconnect_frees_slots(mesh, client):
    async def run() -> int:
        async with httpx.AsyncClient(base_url=mesh.url, timeout=300) as http:
            body = {"text": "Write a long essay.", "stream": True,
                    "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
            other = asyncio.create_task(http.post("/generate", json={
                "text": "Hi", "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}))
            async with http.stream("POST", "/generate", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break  # hang up after the first chunk
            return (await other).json()["meta_info"]["completion_tokens"]

    assert asyncio.run(run()) == 24
    info = wait_idle(client, timeout=10)
    assert info["free_slots"] + info["cached_tokens"] == info["num_slots"]


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/generate", "{not json", "json"),
        ("/generate", {"text": 5}, "text"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.5}}, "temperature"),
        ("/generate", {"text": "word " * 9000}, "context length"),
        ("/v1/completions", {"model": "MODEL", "prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {"model": "MODEL", "prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, "no-such-model"),
        ("/v1/chat/completions", {"model": "MODEL", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "MODEL", "messages": "hi"}, "messages"),
        ("/v1/completions", {"model": "MODEL", "prompt": "word " * 9000}, "context length"),
    ],
)
def test_bad_input_is_a_400_naming_the_problem(client, path, body, needle):
    model = client.get("/v1/models").json()["data"][0]["id"]
    if isinstance(body, dict):
        body = json.dumps(body).replace("MODEL", model)
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"].lower()
    ok = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


# ---- one check of a request, whatever the door ----------------------------------------------
# Each case: SGLang's sampling fields, the error every door gives (None: whatever the native
# door says), with {max} for the output limit's field as that door's clients name it, and the
# field an OpenAI error names.
PROMPT_IDS = [504, 3153, 314]  # three tokens of the vocabulary
REFUSED = {
    "over the context": ({"max_new_tokens": 8192},
                         "prompt (3 tokens) + {max} (8192) exceeds the model's context "
                         "length of 8192", "max_tokens"),
    "top_k over the vocabulary": ({"top_k": 60000, "max_new_tokens": 4},
                                  "top_k must be <= the vocabulary size 49152, got 60000",
                                  "top_k"),
    "a stop token outside the vocabulary": ({"stop_token_ids": [60000], "max_new_tokens": 4},
                                            None, "stop_token_ids"),
    "a regex that does not parse": ({"regex": "(ab", "max_new_tokens": 4}, None, "regex"),
}


def _native(client: httpx.Client, sampling: dict, **prompt) -> str:
    answer = client.post("/generate", json={**prompt, "sampling_params": sampling})
    assert answer.status_code == 400, answer.text
    return answer.json()["error"]["message"]


def _openai(client: httpx.Client, sampling: dict, route: str, **prompt) -> tuple[str, str]:
    fields = {("max_tokens" if k == "max_new_tokens" else k): v for k, v in sampling.items()}
    answer = client.post(route, json={**prompt, **fields})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    return error["message"], error["param"]


def _grpc(mesh: Mesh, sampling: dict, input_ids: list[int]) -> str:
    async def run() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(mesh.grpc_addrs[0]) as channel:
            request = gpb.GenerateRequest(
                input_ids=gpb.TokenIds(ids=input_ids),
                sampling_params=gpb.ClientSamplingParams(**sampling),
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [r async for r in ggrpc.GenerateStub(channel).Generate(request)]
            return refused.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    return error.details()


def _engine(engine: Engine, sampling: dict, **prompt) -> str:
    with pytest.raises(ValueError) as refused:
        engine.generate(sampling_params=sampling, **prompt)
    return str(refused.value)


@pytest.mark.parametrize("case", REFUSED)
def test_every_front_door_refuses_a_bad_request_for_the_same_reason(mesh, client, engine,
                                                                    case):
    sampling, expected, openai_param = REFUSED[case]
    native = _native(client, sampling, input_ids=PROMPT_IDS)
    if expected is not None:
        assert native == expected.format(max="max_new_tokens")
    assert _engine(engine, sampling, input_ids=PROMPT_IDS) == native
    assert _grpc(mesh, sampling, input_ids=PROMPT_IDS) == native
    message, param = _openai(client, sampling, "/v1/completions", prompt=PROMPT_IDS)
    assert message == native.replace("max_new_tokens", "max_tokens")
    assert param == openai_param
    if "max_new_tokens (" not in native:  # a chat's prompt is the rendered template's length
        chat = [{"role": "user", "content": "Hi"}]
        assert _openai(client, sampling, "/v1/chat/completions", messages=chat)[0] == native
    # the frontend language, in process and over HTTP
    if set(sampling) <= {"max_new_tokens", "regex"}:
        @lang.function
        def program(s):
            s += "Hello"
            s += lang.gen("x", max_tokens=sampling["max_new_tokens"], regex=sampling.get("regex"))

        said = _native(client, {**sampling, "temperature": 0.0}, text="Hello")
        with pytest.raises(ValueError) as refused:
            program.run(backend=lang.EngineBackend(engine))
        assert str(refused.value) == said
        with pytest.raises(ValueError) as refused:
            program.run(backend=lang.HttpBackend(mesh.url))
        assert json.dumps(said)[1:-1] in str(refused.value)
        with pytest.raises(ValueError) as refused:
            program.run(backend=lang.GrpcBackend(mesh.grpc_addrs[0]))
        assert str(refused.value) == said
    assert wait_idle(client)["held_slots"] == 0


def test_a_prompt_outside_the_vocabulary_is_named_as_each_door_calls_it(mesh, client, engine):
    ids = [*PROMPT_IDS, 60000]
    expected = "{} entries must be in [0, 49152), got 60000"
    assert _native(client, {}, input_ids=ids) == expected.format("input_ids")
    assert _engine(engine, {}, input_ids=ids) == expected.format("input_ids")
    assert _grpc(mesh, {}, input_ids=ids) == expected.format("input_ids")
    assert _openai(client, {}, "/v1/completions", prompt=ids) == (expected.format("prompt"),
                                                                   "prompt")


@lang.function
def sightseeing(s, city):
    s += lang.user(f"Name one thing to see in {city}.")
    s += lang.assistant(lang.gen("sight", max_tokens=8, stop="\n"))
    forks = s.fork(2)
    for i, branch in enumerate(forks):
        branch += lang.user(("Is it old?", "Is it free?")[i])
        branch += lang.assistant(lang.select(f"answer{i}", ["Yes", "No"]))
    forks.join()


def test_lang_programs_run_alike_in_process_over_http_and_grpc(mesh, engine):
    """Roles (the template from /get_model_info), a fork and a select: the same greedy
    program on every backend (streamed through the mesh)."""
    template = lang.ChatTemplate.from_server(mesh.url)
    backends = {
        "engine": lang.EngineBackend(engine),
        "http": lang.HttpBackend(mesh.url),
        "grpc": lang.GrpcBackend(mesh.grpc_addrs[0], chat_template=template),
    }
    expected = sightseeing.run(backends.pop("engine"), city="Rome")
    assert set(expected.variables) == {"sight", "answer0", "answer1"}
    for backend in backends.values():
        streamed = sightseeing.run(backend, stream=True, city="Rome")
        assert "".join(streamed.text_iter()) == expected.text()
        assert streamed.variables == expected.variables


SGLANG_PROGRAM = """
import json, sys
import sglang as sgl

@sgl.function
def program(s):
    s += "The capital of France is" + sgl.gen("city", max_tokens=8, temperature=0)
    s += ". Is it large? " + sgl.select("large", ["yes", "no"])
    forks = s.fork(2)
    for i, branch in enumerate(forks):
        branch += f" Reason {i + 1}:" + sgl.gen("reason", max_tokens=6, temperature=0)
    forks.join()
    s += "|".join(branch["reason"] for branch in forks)

state = program.run(backend=sgl.RuntimeEndpoint(sys.argv[1]))
print(json.dumps({"city": state["city"], "large": state["large"], "text": state.text()}))
"""


@pytest.fixture(scope="module")
def sglang_path(tmp_path_factory) -> str:
    """A PYTHONPATH with SGLang's frontend: the sglang package without its runtime's
    dependencies (torch kernels and the like), and what its frontend imports."""
    folder = tmp_path_factory.mktemp("sglang")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", "--target", str(folder), "sglang==0.5.23"], check=True)
    subprocess.run([*pip, "--target", str(folder / "deps"), "orjson", "pybase64", "starlette",
                    "msgspec", "pyzmq", "ipython"], check=True)
    return f"{folder}{os.pathsep}{folder / 'deps'}"


def test_sglangs_own_frontend_runs_against_the_mesh(mesh, sglang_path):
    """SGLang's frontend, unchanged, in a process of its own (importing it patches
    transformers), answers as radixmesh.lang on the same mesh."""
    done = subprocess.run([sys.executable, "-c", SGLANG_PROGRAM, mesh.url],
                          capture_output=True, text=True, timeout=120, check=True,
                          env={**os.environ, "PYTHONPATH": sglang_path})
    got = json.loads(done.stdout.splitlines()[-1])

    @lang.function
    def ours(s):
        s += "The capital of France is" + lang.gen("city", max_tokens=8)
        s += ". Is it large? " + lang.select("large", ["yes", "no"])
        forks = s.fork(2)
        for i, branch in enumerate(forks):
            branch += f" Reason {i + 1}:" + lang.gen("reason", max_tokens=6)
        forks.join()
        s += "|".join(branch["reason"] for branch in forks)

    state = ours.run(lang.HttpBackend(mesh.url))
    assert got == {"city": state["city"], "large": state["large"], "text": state.text()}
