"""`radixmesh up --tp 3` on the real SmolLM2 (9 query / 3 KV heads): three worker ranks in
one gloo group driven by one scheduler give the in-process engine's exact tokens, free and
constrained (rank 0 samples and jumps forward; the other ranks follow), with n-gram drafts
verified on all three (rank 0 walks the tree, the others keep the path it sends). SIGKILL of one
rank under load: the engine's requests end with a clear error, the supervisor restarts the
whole group (the ranks share one collective group), and the engine serves the same exact
tokens again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
from process_helpers import running_mesh


def generate(url: str, text: str, params: dict) -> dict:
    return httpx.post(url + "/generate", json={"text": text, "sampling_params": params},
                      timeout=120).json()


async def killed_under_load(url: str, pid: int, n: int) -> list[dict]:
    """n long requests at once; the rank is killed once they are under way."""
    body = {"sampling_params": {"temperature": 0, "max_new_tokens": 256, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        calls = [asyncio.create_task(client.post("/generate", json={"text": f"Tale {i}:", **body}))
                 for i in range(n)]
        await asyncio.sleep(2)
        os.kill(pid, signal.SIGKILL)
        return [r.json() for r in await asyncio.gather(*calls)]


def test_tensor_parallel_mesh_matches_in_process_engine_and_survives_a_rank(tmp_path):
    from radixmesh.api import Engine

    prompts = ["The three primary colors are", "Describe a customer as JSON.",
               "Repeat: one two three four five six seven eight, one two three four five six"]
    schema = {"type": "object", "required": ["customer_full_legal_name", "years_as_customer"],
              "properties": {"customer_full_legal_name": {"type": "string", "maxLength": 12},
                             "years_as_customer": {"type": "integer", "maximum": 99}}}
    params = [{"temperature": 0, "max_new_tokens": 8},
              {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(schema)},
              {"temperature": 0, "max_new_tokens": 24}]
    with Engine(dtype="float32", max_total_tokens=1024, show_progress=False) as engine:
        expected = [o["output_ids"] for o in engine.generate(prompts, params)]
        assert engine.server_info()["forced_tokens"] > 0
    with running_mesh(tmp_path, tp_size=3, dtype="float32", max_total_tokens=1024,
                      speculative_algorithm="NGRAM") as mesh:
        got = [generate(mesh.url, t, p)["output_ids"]
               for t, p in zip(prompts, params, strict=True)]
        info = httpx.get(mesh.url + "/server_info").json()["internal_states"][0]
        assert got == expected
        assert info["tp_size"] == 3 and info["forced_tokens"] > 0
        assert info["spec_accepted_tokens"] > 0

        rank = next(c for c in mesh.children if c.name == "worker-0.1")
        started = time.monotonic()
        replies = asyncio.run(killed_under_load(mesh.url, rank.proc.pid, 3))
        assert time.monotonic() - started < 30, "a request hung"
        for reply in replies:
            finish = reply["meta_info"]["finish_reason"]
            assert finish["type"] == "abort", reply["meta_info"]
            assert "engine e0 lost its worker" in finish["message"], finish
        deadline = time.monotonic() + 120
        while True:  # the engine is back once the group is: the same exact tokens
            reply = generate(mesh.url, prompts[0], params[0])
            # Until then a request is refused, or ends aborted if the engine loses a rank
            # again while the group is still coming back.
            if "output_ids" in reply and reply["meta_info"]["finish_reason"]["type"] != "abort":
                break
            assert time.monotonic() < deadline, reply
            time.sleep(1)
        assert reply["output_ids"] == expected[0]
        restarts = mesh.supervisor.restarts()
        assert all(restarts[f"worker-0.{r}"] == 1 for r in range(3)), restarts  # as a group
        assert generate(mesh.url, prompts[1], params[1])["output_ids"] == expected[1]
        assert httpx.get(mesh.url + "/server_info").json()["internal_states"][0][
            "held_slots"] == 0


def test_prefill_ranks_send_their_heads_to_a_decode_engine_of_other_size(tmp_path):
    """Prefill/decode disaggregation across tensor-parallel sizes: a prefill engine of 3
    ranks (one KV head each) streams each rank's head into the one decode worker, which
    gives the in-process engine's exact tokens."""
    from radixmesh.api import Engine

    prompts = ["The three primary colors are", "Describe a customer as JSON."]
    params = {"temperature": 0, "max_new_tokens": 12}
    with Engine(dtype="float32", max_total_tokens=1024, show_progress=False) as engine:
        expected = [o["output_ids"] for o in engine.generate(prompts, params)]
    with running_mesh(tmp_path, prefill_dp_size=1, decode_dp_size=1, prefill_tp_size=3,
                      dtype="float32", max_total_tokens=1024) as mesh:
        got = [generate(mesh.url, t, params) for t in prompts]
    assert [g["output_ids"] for g in got] == expected
    for g in got:
        moved = g["meta_info"]["disaggregation"]
        assert "fallback" not in moved, moved
        assert moved["transfer_tokens"] == g["meta_info"]["prompt_tokens"]
