"""The tokenizer's public gRPC port against fake engines on a real NATS server: Generate
(streams, bad requests, cancellation), server reflection, the health service, and a client
built from generate.proto alone."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from fake_engine import FakeEngine, echo_ids, host_part, output_logprob, token_text
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from grpc_tools import protoc

from radixmesh.core.service_settings import TokenizerServiceConfig
from radixmesh.proto import generate_pb2 as gpb
from radixmesh.proto import generate_pb2_grpc as ggrpc
from radixmesh.services.tokenizer.server import TokenizerServer

pytestmark = pytest.mark.anyio


# ---- gRPC Generate -----------------------------------------------------------------------


@pytest.fixture
async def grpc_server(nats_url, tokenizer):
    config = TokenizerServiceConfig(nats_url=nats_url, port=0, grpc_port=0,
                                    replica_id=os.urandom(6).hex())
    server = TokenizerServer(config, tokenizer=tokenizer)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def grpc_stack(grpc_server, nc):
    server = grpc_server
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    stub = ggrpc.GenerateStub(channel)
    engines: list[FakeEngine] = []

    async def add_engine(**options) -> FakeEngine:
        engine = await FakeEngine(nc, f"g-{os.urandom(3).hex()}", **options).start()
        engines.append(engine)
        await server.client.wait_for_engines(len(engines))
        return engine

    yield stub, add_engine
    await channel.close()
    for engine in engines:
        await engine.stop()


async def test_grpc_generate_streams_deltas_and_finishes(grpc_stack):
    stub, add_engine = grpc_stack
    await add_engine()
    request = gpb.GenerateRequest(
        input_ids=gpb.TokenIds(ids=[21, 22, 23]),
        sampling_params=gpb.ClientSamplingParams(max_new_tokens=2, temperature=0.0),
        return_logprob=True, top_logprobs_num=1, rid="g1",
    )
    replies = [r async for r in stub.Generate(request)]
    # Deltas (tokens that came together share a reply).
    assert "".join(r.text for r in replies) == token_text(21) + token_text(22)
    assert [t for r in replies for t in r.output_ids] == [21, 22]
    assert [r.completion_tokens for r in replies] == list(
        itertools.accumulate(len(r.output_ids) for r in replies))
    last = replies[-1]
    assert last.rid == "g1" and last.completion_tokens == 2 and last.prompt_tokens == 3
    assert last.finish.kind == "length" and last.finish.token_id == 2
    assert [e.token_id for e in last.input_token_logprobs] == [21, 22, 23]
    assert not last.input_token_logprobs[0].has_logprob
    assert last.input_token_logprobs[1].has_logprob
    assert math.isclose(replies[0].output_token_logprobs[0].logprob, output_logprob(0),
                        rel_tol=1e-6)
    assert replies[0].output_top_logprobs[0].items[0].token_id == 21


async def test_grpc_reports_cached_tokens_by_tier(grpc_stack):
    stub, add_engine = grpc_stack
    await add_engine()
    request = gpb.GenerateRequest(input_ids=gpb.TokenIds(ids=[41, 42, 43, 44, 45, 46]),
                                  sampling_params=gpb.ClientSamplingParams(max_new_tokens=2))
    cold = [r async for r in stub.Generate(request)]
    warm = [r async for r in stub.Generate(request)]
    assert all(r.cached_tokens == 0 for r in cold)
    assert all(r.cached_tokens_details == gpb.CachedTokensDetails() for r in cold)
    host = host_part(6)
    assert host > 0
    for reply in warm:
        assert reply.cached_tokens == 6
        assert reply.cached_tokens_details == gpb.CachedTokensDetails(device=6 - host, host=host)


async def test_grpc_text_prompt_is_tokenized(grpc_stack, tokenizer):
    stub, add_engine = grpc_stack
    engine = await add_engine()
    request = gpb.GenerateRequest(text="Hello there",
                                  sampling_params=gpb.ClientSamplingParams(max_new_tokens=1))
    _ = [r async for r in stub.Generate(request)]
    assert list(engine.requests[0].input_ids) == tokenizer.encode("Hello there")
    assert engine.requests[0].logprob_start_len == -1


async def test_grpc_sampling_fields_reach_the_engine(grpc_stack):
    stub, add_engine = grpc_stack
    engine = await add_engine()
    sampling = gpb.ClientSamplingParams(
        max_new_tokens=1, logit_bias={5: -100.0, 6: 1.5}, stop_token_ids=[9], ignore_eos=True,
        skip_special_tokens=False, spaces_between_special_tokens=False, no_stop_trim=True,
    )
    request = gpb.GenerateRequest(input_ids=gpb.TokenIds(ids=[1, 2]), sampling_params=sampling)
    _ = [r async for r in stub.Generate(request)]
    plain = gpb.GenerateRequest(input_ids=gpb.TokenIds(ids=[1, 2]),
                                sampling_params=gpb.ClientSamplingParams(max_new_tokens=1))
    _ = [r async for r in stub.Generate(plain)]
    sent, default = engine.requests
    assert dict(sent.sampling.logit_bias) == {5: -100.0, 6: 1.5}
    assert list(sent.sampling.stop_token_ids) == [9] and sent.sampling.ignore_eos
    assert not sent.detok.skip_special_tokens and not sent.detok.spaces_between_special_tokens
    assert sent.detok.no_stop_trim
    assert not default.sampling.logit_bias and default.detok.spaces_between_special_tokens


@pytest.mark.parametrize(
    ("request_fields", "needle"),
    [
        ({}, "text or input_ids"),
        ({"input_ids": gpb.TokenIds(ids=[1]),
          "sampling_params": gpb.ClientSamplingParams(logit_bias={1: 150.0})}, "logit_bias"),
        ({"input_ids": gpb.TokenIds(ids=[1]),
          "sampling_params": gpb.ClientSamplingParams(logit_bias={-2: 1.0})}, "logit_bias"),
        ({"input_ids": gpb.TokenIds(ids=[])}, "empty"),
        ({"input_ids": gpb.TokenIds(ids=[1]),
          "sampling_params": gpb.ClientSamplingParams(temperature=-1)}, "temperature"),
        ({"input_ids": gpb.TokenIds(ids=[1] * 5000)}, "context length"),
    ],
)
async def test_grpc_bad_requests_are_invalid_argument(grpc_stack, request_fields, needle):
    stub, add_engine = grpc_stack
    await add_engine()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _ = [r async for r in stub.Generate(gpb.GenerateRequest(**request_fields))]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()


async def test_grpc_without_engines_is_unavailable(grpc_stack):
    stub, _ = grpc_stack
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _ = [r async for r in stub.Generate(gpb.GenerateRequest(text="hi"))]
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_grpc_cancelled_call_aborts_the_request(grpc_stack):
    stub, add_engine = grpc_stack
    engine = await add_engine(hold=True)
    call = stub.Generate(gpb.GenerateRequest(input_ids=gpb.TokenIds(ids=[1, 2]), rid="gc"))
    first = await call.read()
    assert list(first.output_ids) == [1]
    call.cancel()
    await engine.wait_for("aborts")
    assert engine.aborts == ["gc"]


# ---- the public gRPC port: reflection, health, a client built from generate.proto alone --

PUBLIC_SERVICES = ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                   "radixmesh.v1.Generate"]
GENERATE_PROTO = Path(__file__).resolve().parents[1] / "proto" / "generate.proto"


def _reflect(port: int) -> tuple[list[str], descriptor_pb2.FileDescriptorProto, list[str]]:
    """What a generic reflection client learns: the services, the file defining Generate,
    and Generate's method as a pool built from reflection alone resolves it. Blocking: run
    it off the server's event loop."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = sorted(db.get_services())
        file = db.FindFileContainingSymbol("radixmesh.v1.Generate")
        method = DescriptorPool(db).FindMethodByName("radixmesh.v1.Generate.Generate")
        resolved = [method.input_type.full_name, method.output_type.full_name]
        return services, file, resolved


async def test_grpc_reflection_lists_the_services_and_serves_generates_descriptor(grpc_server):
    services, file, resolved = await asyncio.to_thread(_reflect, grpc_server.grpc_port)
    assert services == PUBLIC_SERVICES
    assert file.package == "radixmesh.v1" and list(file.dependency) == []
    [service] = file.service
    assert service.name == "Generate"
    assert [(m.name, m.input_type, m.output_type, m.server_streaming)
            for m in service.method] == [
        ("Generate", ".radixmesh.v1.GenerateRequest", ".radixmesh.v1.GenerateResponse", True),
        ("Embed", ".radixmesh.v1.EmbedRequest", ".radixmesh.v1.EmbedResponse", False)]
    assert resolved == ["radixmesh.v1.GenerateRequest", "radixmesh.v1.GenerateResponse"]


async def test_grpc_health_is_serving_until_the_tokenizer_begins_to_stop(nats_url, tokenizer):
    config = TokenizerServiceConfig(nats_url=nats_url, port=0, grpc_port=0,
                                    replica_id=os.urandom(6).hex())
    server = TokenizerServer(config, tokenizer=tokenizer)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    health = health_pb2_grpc.HealthStub(channel)
    try:
        for service in ("", "radixmesh.v1.Generate"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        watch = health.Watch(health_pb2.HealthCheckRequest(service="radixmesh.v1.Generate"))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        stopping = asyncio.create_task(server.stop())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()  # an open call would hold the stop for its grace period
        await stopping
    finally:
        await channel.close()


# Run by a separate interpreter: the modules compiled from generate.proto alone define the
# same radixmesh.v1 symbols as radixmesh.proto.generate_pb2, and one process's descriptor
# pool refuses a second definition.
_STANDALONE_CLIENT = """
import json, sys
sys.path.insert(0, sys.argv[2])
import grpc
import generate_pb2, generate_pb2_grpc

request = generate_pb2.GenerateRequest(
    input_ids=generate_pb2.TokenIds(ids=[31, 32, 33]),
    sampling_params=generate_pb2.ClientSamplingParams(max_new_tokens=4),
    rid="standalone",
)
with grpc.insecure_channel(sys.argv[1]) as channel:
    replies = list(generate_pb2_grpc.GenerateStub(channel).Generate(request))
print(json.dumps({
    "file": generate_pb2.DESCRIPTOR.name,
    "radixmesh_loaded": any(name.startswith("radixmesh") for name in sys.modules),
    "replies": [[r.rid, r.text, list(r.output_ids), r.completion_tokens] for r in replies],
    "finish": [replies[-1].finish.kind, replies[-1].finish.token_id],
    "cached": [replies[-1].cached_tokens, replies[-1].cached_tokens_details.device,
               replies[-1].cached_tokens_details.host, replies[-1].cached_tokens_details.storage],
}))
"""


async def test_a_client_compiled_from_generate_proto_alone_calls_generate(grpc_server,
                                                                           grpc_stack, tmp_path):
    stub, add_engine = grpc_stack
    await add_engine()
    # The same prompt first, so the standalone client sees a cache hit split by tier.
    warmup = gpb.GenerateRequest(input_ids=gpb.TokenIds(ids=[31, 32, 33]),
                                 sampling_params=gpb.ClientSamplingParams(max_new_tokens=1))
    _ = [r async for r in stub.Generate(warmup)]
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    shutil.copy(GENERATE_PROTO, src / "generate.proto")
    args = ["grpc_tools.protoc", f"-I{src}", f"--python_out={out}", f"--grpc_python_out={out}",
            "generate.proto"]
    assert protoc.main(args) == 0
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-c", _STANDALONE_CLIENT, f"127.0.0.1:{grpc_server.grpc_port}",
        str(out), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()
    got = json.loads(stdout)
    assert got["file"] == "generate.proto" and not got["radixmesh_loaded"]
    ids = echo_ids([31, 32, 33], 4)
    assert ids == [31, 32, 33, 31]
    replies = got["replies"]
    assert {r[0] for r in replies} == {"standalone"}
    assert "".join(r[1] for r in replies) == "".join(map(token_text, ids))
    assert [t for r in replies for t in r[2]] == ids
    assert [r[3] for r in replies] == list(itertools.accumulate(len(r[2]) for r in replies))
    assert got["finish"] == ["length", 4]
    assert got["cached"] == [3, 3 - host_part(3), host_part(3), 0]
