"""Every kernel compiles for an sm_90 GPU (H100/H200) from its real host wrapper, with no GPU
here: catches what the interpreter cannot (GPU-only type rules, tensor-core shapes, shared
memory). It runs in a subprocess because the other kernel tests load the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Shared memory one sm_90 thread block may use.
SM90_SHARED_BYTES = 227 * 1024


def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert {r["kernel"] for r in reports} == {
        "_split_kernel",
        "_merge_kernel",
        "_extend_kernel",
        "_store_kernel",
        "_rms_norm_kernel",
        "_rotary_kernel",
        "_silu_and_mul_kernel",
        "_bitmask_kernel",
        "_grouped_gemm_kernel",
        "_lora_shrink_kernel",
        "_lora_expand_kernel",
    }
    assert all(r["shared_bytes"] <= SM90_SHARED_BYTES for r in reports)
    # bf16 attention runs its matrix products on tensor cores; float32 stays IEEE (no TF32)
    attention = [r for r in reports if r["kernel"] in ("_split_kernel", "_extend_kernel")]
    bf16 = [r["signature"]["q_ptr"] == "*bf16" for r in attention]
    assert bf16.count(True) == 8 and bf16.count(False) == 2
    assert [r["tensor_cores"] for r in attention] == bf16
    # so do the fused MoE's grouped GEMMs
    moe = [r for r in reports if r["kernel"] == "_grouped_gemm_kernel"]
    assert sorted(r["tensor_cores"] for r in moe) == [False, False, True, True]
    lora = [r for r in reports if r["kernel"].startswith("_lora")]
    assert [r["tensor_cores"] for r in lora] == [True, True]
