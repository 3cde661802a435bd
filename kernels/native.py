"""Native CPU kernels: the C++ in kernels/cpu/, built by the system C++ compiler on first
use and loaded with ctypes (calls release the GIL).

Its settings (`NativeKernelSettings`, read from RADIXMESH_NATIVE_KERNELS,
RADIXMESH_NATIVE_MARCH and RADIXMESH_CACHE): the library is cached under the cache directory
(default ~/.cache/radixmesh), keyed by the sources, the compiler, the flags and this CPU's
feature flags, so each machine builds it once. Without a compiler, or with native_kernels
false, `library()` is None and callers keep their torch path. It links OpenMP by soname, so
it shares the runtime (and the thread pool) that torch has already loaded. native_march
(default native) is the -march it builds for, optionally followed by further -m flags."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from radixmesh.core.flags import from_environment
from radixmesh.core.settings import NativeKernelSettings

log = logging.getLogger("radixmesh.kernels")

SOURCES = sorted((Path(__file__).parent / "cpu").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "cpu").glob("*.h"))
FLAGS = ("-O3", "-std=c++17", "-fopenmp", "-shared", "-fPIC")
_PTR, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_DECODE_ARGS = [_PTR] * 6 + [_INT] * 5 + [_FLOAT, _INT]


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _cache_dir(settings: NativeKernelSettings) -> Path:
    return Path(settings.cache or Path.home() / ".cache" / "radixmesh") / "kernels"


def _arch_flags(settings: NativeKernelSettings) -> list[str]:
    march, *extra = (settings.native_march or "native").split()
    return [f"-march={march}", *extra]


def _build(compiler: str, settings: NativeKernelSettings) -> Path:
    flags = [*FLAGS, *_arch_flags(settings)]
    digest = hashlib.sha256()
    for part in (compiler, " ".join(flags), platform.machine(), _cpu_flags()):
        digest.update(part.encode())
    for src in (*SOURCES, *HEADERS):
        digest.update(src.read_bytes())
    out = _cache_dir(settings) / f"radixmesh-cpu-{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: processes starting together never load a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as objects:
            _compile_all(compiler, flags, Path(objects), tmp)
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users of the cache out
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _compile_all(compiler: str, flags: list[str], objects: Path, target: str) -> None:
    """Compile every source to an object at once (one process each), then link."""
    compile_flags = [f for f in flags if f != "-shared"]
    jobs = [
        (subprocess.Popen([compiler, *compile_flags, "-c", str(src), "-o", str(obj)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), obj)
        for src in SOURCES
        for obj in [objects / f"{src.stem}.o"]
    ]
    errors = []
    for proc, _ in jobs:
        _, err = proc.communicate()
        if proc.returncode:
            errors.append(err)
    if errors:
        raise subprocess.CalledProcessError(1, compiler, stderr="".join(errors))
    subprocess.run([compiler, *flags, *(str(obj) for _, obj in jobs), "-o", target],
                   check=True, capture_output=True, text=True)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded native library, or None where it cannot be built (logged once)."""
    try:
        settings = from_environment(NativeKernelSettings)
    except ValueError as exc:
        log.warning("native CPU kernels off, torch fallbacks used: %s", exc)
        return None
    if not settings.native_kernels:
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        log.warning("no C++ compiler found: native CPU kernels off, torch fallbacks used")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler, settings)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native CPU kernels failed to build, torch fallbacks used: %s", detail)
        return None
    for name in ("decode_attention_f32", "decode_attention_bf16"):
        getattr(lib, name).argtypes = _DECODE_ARGS
        getattr(lib, name).restype = None
    lib.gemm_bf16.argtypes = [_PTR] * 5 + [_INT] * 4
    lib.gemm_bf16.restype = None
    lib.gemm_bf16_supported.argtypes = [_INT]
    lib.gemm_bf16_supported.restype = _INT
    for name in ("rms_norm_f32", "rms_norm_bf16"):
        getattr(lib, name).argtypes = [_PTR] * 3 + [_INT] * 2 + [_FLOAT, _INT]
        getattr(lib, name).restype = None
    for name in ("rotary_f32", "rotary_bf16"):
        getattr(lib, name).argtypes = [_PTR] * 4 + [_INT] * 2 + [ctypes.c_int64, _INT, _INT]
        getattr(lib, name).restype = None
    lib.silu_mul_bf16_rows.argtypes = [_PTR] * 2 + [_INT] * 3
    lib.silu_mul_bf16_rows.restype = None
    lib.argmax_rows_f32.argtypes = [_PTR] * 2 + [_INT] * 3
    lib.argmax_rows_f32.restype = None
    return lib


def _takes(*tensors: torch.Tensor) -> bool:
    """Whether the library is built and these are CPU tensors of one float32/bf16 dtype."""
    dtype = tensors[0].dtype
    return (
        dtype in (torch.float32, torch.bfloat16)
        and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
        and library() is not None
    )


def check_rows(what: str, values: torch.Tensor, rows: int) -> None:
    """Raise IndexError unless every value indexes one of `rows` rows: the kernels read raw
    memory at them."""
    if values.numel() and not 0 <= int(values.min()) <= int(values.max()) < rows:
        raise IndexError(f"{what} out of range [0, {rows})")


# Below this much work (multiply-adds, or elements for elementwise kernels) a call runs on
# one thread: waking a second costs more than it saves, and on a host whose cores the
# engine's other threads share, a team that waits at a barrier for a descheduled thread
# stalls the whole step (a 64-wide model's decode step took ~4x longer on two threads).
_PARALLEL_WORK = 1 << 18


def threads_for(work: int) -> int:
    """Threads for a kernel call of `work` units: one for small calls, else torch's."""
    return 1 if work < _PARALLEL_WORK else torch.get_num_threads()


def decode_supported(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether `decode_attention` takes these tensors here."""
    return _takes(q, k_pool)


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    index: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, D] over pool rows [S, Hkv, D] at index [B, W] (first lens[b] live) ->
    [B, Hq, D]; the same result as TorchAttention's torch decode path."""
    assert index.shape[0] == q.shape[0]
    return _attend(q, k_pool, v_pool, index, index.shape[1], lens, scale)


def extend_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """A request's last n tokens q [n, Hq, D] over its keys at pool rows `slots` [L], causally:
    token i sees slots[: L - n + i + 1]. Each token runs as a decode over one shared index."""
    total = slots.numel()
    return _attend(q, k_pool, v_pool, slots.view(1, total), 0, causal_lens(q.shape[0], total),
                   scale)


def causal_lens(new: int, total: int) -> torch.Tensor:
    """How many of a request's `total` keys each of its last `new` tokens sees (causal)."""
    return torch.arange(total - new + 1, total + 1)


def _attend(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    index: torch.Tensor,
    width: int,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Query b reads index row b (rows `width` apart; 0: all share row 0)."""
    lib = library()
    assert lib is not None and decode_supported(q, k_pool)
    b, hq, d = q.shape
    hkv = k_pool.shape[1]
    assert hq % hkv == 0 and k_pool.shape[2] == d and v_pool.shape == k_pool.shape
    assert index.dtype == lens.dtype == torch.int64 and lens.shape[0] == b
    q, index, lens = q.contiguous(), index.contiguous(), lens.contiguous()
    assert k_pool.is_contiguous() and v_pool.is_contiguous()
    check_rows("slot", index, k_pool.shape[0])
    out = torch.empty_like(q)
    fn = lib.decode_attention_bf16 if q.dtype == torch.bfloat16 else lib.decode_attention_f32
    fn(
        q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), index.data_ptr(), lens.data_ptr(),
        out.data_ptr(), b, width, hq, hkv, d, scale, threads_for(index.numel() * hq * d),
    )
    return out


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes these tensors here."""
    return weight.is_contiguous() and _takes(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [..., D] with weight [D], in float32, rounded once
    to x's dtype: torch's rms_norm in one pass."""
    lib = library()
    assert lib is not None
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    fn = lib.rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.rms_norm_f32
    fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
       threads_for(x.numel()))
    return out


def rotary_supported(x: torch.Tensor, table: torch.Tensor) -> bool:
    """Whether `rotary_` takes x [T, H, D] (heads side by side in each row) and this table."""
    return (
        x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and x.shape[2] % 2 == 0
        and table.is_contiguous()
        and _takes(x, table)
    )


def rotary_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate x [T, H, D] in place by the rows `positions` [T] of cos/sin [P, D]: the same
    values as rope.apply_rotary on the looked-up tables."""
    lib = library()
    assert lib is not None and rotary_supported(x, cos) and sin.is_contiguous()
    assert positions.dtype == torch.int64 and positions.shape == (x.shape[0],)
    positions = positions.contiguous()
    check_rows("position", positions, cos.shape[0])
    fn = lib.rotary_bf16 if x.dtype == torch.bfloat16 else lib.rotary_f32
    fn(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0],
       x.shape[1], x.stride(0), x.shape[2], threads_for(x.numel()))
    return x


def silu_mul_supported(x: torch.Tensor) -> bool:
    """Whether `silu_mul` takes x [T, 2I] here (bf16 only: float32 keeps torch's exp)."""
    return x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] % 2 == 0 and _takes(x)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I], rounded as torch's two ops round."""
    lib = library()
    assert lib is not None and silu_mul_supported(x)
    x = x.contiguous()
    width = x.shape[1] // 2
    out = torch.empty(x.shape[0], width, dtype=x.dtype)
    lib.silu_mul_bf16_rows(x.data_ptr(), out.data_ptr(), x.shape[0], width,
                           threads_for(x.numel()))
    return out


def argmax_supported(x: torch.Tensor) -> bool:
    """Whether `argmax` takes x [B, V] here (float32 on the CPU)."""
    return x.dtype == torch.float32 and x.dim() == 2 and _takes(x)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] float32 -> int64 [B]: torch.argmax(x, dim=-1), first index of the largest
    value (or of the first NaN), ~10x faster."""
    lib = library()
    assert lib is not None and argmax_supported(x)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows_f32(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                        threads_for(x.numel()))
    return out


# Output features per packed block of `gemm` (kFeatures in cpu/gemm.cpp).
GEMM_FEATURES = 32


def gemm_supported(weight: torch.Tensor) -> bool:
    """Whether `gemm` takes this weight [N, K] here (bf16 on the CPU, K even, AVX512-BF16)."""
    return (
        weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and _takes(weight)
        and bool(library().gemm_bf16_supported(weight.shape[1]))  # type: ignore[union-attr]
    )


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (K even) as `gemm` reads it: [N/32][K/2][32][2], N padded with zeros."""
    n, k = weight.shape
    padded = -(-n // GEMM_FEATURES) * GEMM_FEATURES
    w = torch.zeros(padded, k, dtype=weight.dtype)
    w[:n] = weight
    w = w.view(padded // GEMM_FEATURES, GEMM_FEATURES, k // 2, 2)
    return w.permute(0, 2, 1, 3).contiguous()


def gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) in bf16, from `pack_gemm_weight(weight)`; plus
    `residual` [M, N] if given, added after rounding as `residual + out` would."""
    lib = library()
    assert lib is not None and x.dtype == torch.bfloat16 and x.shape[1] == packed.shape[1] * 2
    assert bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())
    x = x.contiguous()
    if residual is not None:
        assert residual.dtype == torch.bfloat16 and residual.shape == (x.shape[0], n)
        residual = residual.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    lib.gemm_bf16(
        x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(), out.data_ptr(), x.shape[0], n,
        x.shape[1], threads_for(x.shape[0] * n * x.shape[1]),
    )
    return out

