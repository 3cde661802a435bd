"""Compile every kernel, through its real host wrapper, for an sm_90 GPU (H100/H200) on a
machine without one: the interpreter proves the arithmetic, this proves the GPU compiler
accepts the same code. Nothing is launched. Prints one JSON line per compiled variant.

Run as a script in a process without TRITON_INTERPRET (see test_kernels_compile.py)."""

from __future__ import annotations

import json
from typing import Any

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.compiler import ASTSource
from triton.runtime.driver import driver

TARGET = GPUTarget("cuda", 90, 32)


class _NoGPU(DriverBase):
    """Just enough of a driver for the JIT to bind arguments and pick the sm_90 target."""

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self) -> Any:
        raise NotImplementedError

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def _compile_instead_of_launch(**hook: Any) -> bool:
    """The JIT's cache hook: compile the variant for sm_90, report it, skip the launch."""
    info, spec = hook["fn"], hook["compile"]
    source = ASTSource(info.jit_function, spec["signature"], spec["constants"], spec["configs"][0])
    options = {k: spec[k] for k in ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")}
    kernel = triton.compile(source, target=TARGET, options=options)
    ptx = kernel.asm["ptx"]
    names = info.jit_function.arg_names
    constants = {names[k[0]]: v for k, v in spec["constants"].items()}
    report = {
        "kernel": info.name,
        "constants": constants,
        "signature": {k: str(v) for k, v in spec["signature"].items() if v != "constexpr"},
        "shared_bytes": kernel.metadata.shared,
        "tensor_cores": "wgmma" in ptx or "mma.sync" in ptx,
    }
    print(json.dumps(report), flush=True)
    return True


def _ints(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.int32)


def main() -> None:
    driver.set_active(_NoGPU())
    knobs.runtime.jit_cache_hook = _compile_instead_of_launch
    # Imported after the driver swap, as a worker would import them on a GPU machine.
    from radixmesh.kernels.activation import silu_and_mul
    from radixmesh.kernels.decode_attention import decode_attention
    from radixmesh.kernels.extend_attention import extend_attention
    from radixmesh.kernels.fused_moe import fused_moe
    from radixmesh.kernels.kv_store import store_kv
    from radixmesh.kernels.lora import lora_add
    from radixmesh.kernels.rms_norm import fused_add_rms_norm, rms_norm
    from radixmesh.kernels.rotary import rotary_embedding
    from radixmesh.kernels.token_bitmask import apply_token_bitmask_

    bf16, f32 = torch.bfloat16, torch.float32
    # (dtype, query heads, KV heads, head dim, page size)
    for dtype, hq, hkv, dim, page in [
        (bf16, 16, 8, 128, 1),
        (bf16, 32, 8, 128, 16),
        (bf16, 9, 3, 64, 1),
        (f32, 9, 3, 64, 16),
    ]:
        q = torch.zeros(4, hq, dim, dtype=dtype)
        kv = torch.zeros(4, hkv, dim, dtype=dtype)
        pool = torch.zeros(64, hkv, dim, dtype=dtype)
        lens = _ints(4) + 1
        decode_attention(q, pool, pool, _ints(4, 4), lens, 0.1, page, num_splits=2)
        extend_attention(q, kv, kv, pool, pool, _ints(4, 4), lens, lens, lens, 1, 0.1, page)
        store_kv(kv, kv, pool, pool, lens)
    # Gemma's layers: a sliding window, soft-capped scores.
    q, kv = torch.zeros(4, 8, 256, dtype=bf16), torch.zeros(4, 4, 256, dtype=bf16)
    pool, lens = torch.zeros(64, 4, 256, dtype=bf16), _ints(4) + 1
    decode_attention(q, pool, pool, _ints(4, 4), lens, 0.1, 1, num_splits=2, window=512,
                     softcap=50.0)
    extend_attention(q, kv, kv, pool, pool, _ints(4, 4), lens, lens, lens, 1, 0.1, 1,
                     window=512, softcap=50.0)
    for dtype in (bf16, f32):
        experts = torch.zeros(4, 2, dtype=torch.long)
        fused_moe(torch.zeros(4, 512, dtype=dtype), torch.zeros(8, 2 * 256, 512, dtype=dtype),
                  torch.zeros(8, 512, 256, dtype=dtype), experts, torch.zeros(4, 2))
    x = torch.zeros(4, 1024, dtype=bf16)
    rms_norm(x, x[0], 1e-6)
    fused_add_rms_norm(x, x, x[0], 1e-6)
    table = torch.zeros(16, 64, dtype=bf16)
    for neox in (True, False):
        rotary_embedding(torch.zeros(4, 24, 128, dtype=bf16), _ints(4), table, table, neox)
    silu_and_mul(torch.zeros(4, 2 * 3072, dtype=bf16))
    # LoRA over a Llama-1B projection: 4 slots of rank 16, a q|k|v output's q columns.
    qkv = torch.zeros(4, 3072, dtype=bf16)
    lora_add(torch.zeros(4, 2048, dtype=bf16), torch.zeros(4, 16, 2048, dtype=bf16),
             torch.zeros(4, 2048, 16, dtype=bf16), _ints(4), qkv[:, :2048])
    apply_token_bitmask_(torch.zeros(4, 151936), _ints(4, 4748))


if __name__ == "__main__":
    main()
