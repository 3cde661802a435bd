"""`radixmesh up --tp 3` on the real SmolLM2 (9 query / 3 KV heads): three worker ranks in
one gloo group driven by one scheduler give the in-process engine's exact tokens."""

from __future__ import annotations

import httpx
from process_helpers import running_mesh


def test_tensor_parallel_mesh_matches_in_process_engine(tmp_path):
    from radixmesh.engine import Engine

    prompt = "The three primary colors are"
    params = {"temperature": 0, "max_new_tokens": 8}
    with Engine(dtype="float32", max_total_tokens=1024, show_progress=False) as engine:
        expected = engine.generate(prompt, params)["output_ids"]
    with running_mesh(tmp_path, tp_size=3, dtype="float32", max_total_tokens=1024) as mesh:
        got = httpx.post(mesh.url + "/generate", json={"text": prompt, "sampling_params": params},
                         timeout=120).json()
        info = httpx.get(mesh.url + "/server_info").json()["internal_states"][0]
    assert got["output_ids"] == expected
    assert info["tp_size"] == 3
