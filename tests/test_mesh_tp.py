"""`radixmesh up --tp 3` on the real SmolLM2 (9 query / 3 KV heads): three worker ranks in
one gloo group driven by one scheduler give the in-process engine's exact tokens, free and
constrained (rank 0 samples and jumps forward; the other ranks follow)."""

from __future__ import annotations

import json

import httpx
from process_helpers import running_mesh


def test_tensor_parallel_mesh_matches_in_process_engine(tmp_path):
    from radixmesh.engine import Engine

    prompts = ["The three primary colors are", "Describe a customer as JSON."]
    schema = {"type": "object", "required": ["customer_full_legal_name", "years_as_customer"],
              "properties": {"customer_full_legal_name": {"type": "string", "maxLength": 12},
                             "years_as_customer": {"type": "integer", "maximum": 99}}}
    params = [{"temperature": 0, "max_new_tokens": 8},
              {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(schema)}]
    with Engine(dtype="float32", max_total_tokens=1024, show_progress=False) as engine:
        expected = [o["output_ids"] for o in engine.generate(prompts, params)]
        assert engine.server_info()["forced_tokens"] > 0
    with running_mesh(tmp_path, tp_size=3, dtype="float32", max_total_tokens=1024) as mesh:
        got = [
            httpx.post(mesh.url + "/generate", json={"text": t, "sampling_params": p},
                       timeout=120).json()["output_ids"]
            for t, p in zip(prompts, params, strict=True)
        ]
        info = httpx.get(mesh.url + "/server_info").json()["internal_states"][0]
    assert got == expected
    assert info["tp_size"] == 3 and info["forced_tokens"] > 0
