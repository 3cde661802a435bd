"""LoRA adapters over one base model: loaded from PEFT's format, held in host memory, and
a fixed pool of device slots that a step's adapters are copied into; each step adds every
row's `B_i (A_i x)` to the projections its adapter targets, one pass per adapter in the
step (never per request).

An adapter is `adapter_config.json` + `adapter_model.safetensors`, as PEFT saves it. Its
`lora_alpha` (or its `alpha_pattern` entry), its ranks (each module's own) and `use_rslora`
(alpha / sqrt(r) instead of alpha / r) are honoured; what is not supported (DoRA, LoRA on
the embeddings or the LM head, trained biases, modules saved whole, expert layers) is
refused by name when it loads."""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixmesh.core.lora_paths import parse_lora_paths
from radixmesh.core.model_files import resolve_adapter_path
from radixmesh.engine.model.memory import lazy_zeros
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.parallel import COLUMN_SPLIT, TensorParallel, local_config
from radixmesh.kernels.native_layer import LoraArgs, LoraProjection

if TYPE_CHECKING:
    from radixmesh.core.settings import LoraSettings
    from radixmesh.kernels.fused_moe import AlignedPicks

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The model's fused projections, and the targets side by side in each one's output.
FUSED = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
KERNEL_BLOCK_M = 16  # tokens per block of the segmented kernels
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(ValueError):
    """An adapter that cannot be served, or a request for one that is not loaded."""


def module_name(layer: int, target: str) -> str:
    """A target's module as PEFT names it under the base model (model.layers.L.mlp.up_proj)."""
    block = "mlp" if target in FUSED["gate_up"] + FUSED["down"] else "self_attn"
    return f"model.layers.{layer}.{block}.{target}"


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target's (in, out) features in the base model."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


@dataclass
class LoraAdapter:
    """One adapter in host memory: per (layer, target) its A [r, in] and its B [out, r]
    already scaled, in float32."""

    name: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.weights.values())

    @property
    def targets(self) -> set[str]:
        return {target for _, target in self.weights}


def load_adapter(name: str, path: str | Path, cfg: ModelConfig) -> LoraAdapter:
    """An adapter from a PEFT folder (or a Hugging Face repo of one), checked against the
    base model `cfg`."""
    try:
        folder = resolve_adapter_path(str(path))
    except (OSError, ValueError) as exc:
        raise LoraError(f"LoRA adapter {name!r}: {exc}") from None
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoraError(f"LoRA adapter {name!r}: cannot read adapter_config.json in "
                        f"{folder} ({exc})") from None
    refused = [
        (config.get("use_dora"), "DoRA (use_dora)"),
        (config.get("bias", "none") not in (None, "none"),
         f"trained biases (bias={config.get('bias')!r})"),
        (config.get("modules_to_save"), "modules saved whole (modules_to_save)"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out weights"),
    ]
    for bad, what in refused:
        if bad:
            raise LoraError(f"LoRA adapter {name!r}: {what} is not supported")
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {folder}")
    from safetensors.torch import load_file

    tensors = load_file(str(file))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match[2] not in TARGETS:
            what = ("embedding or LM head LoRA" if "embed" in key or "lm_head" in key
                    else "a module other than q/k/v/o_proj and gate/up/down_proj")
            raise LoraError(f"LoRA adapter {name!r}: {key} is {what}, which is not supported")
        layer, target = int(match[1]), match[2]
        if layer >= cfg.num_layers:
            raise LoraError(f"LoRA adapter {name!r}: {key} is past the model's "
                            f"{cfg.num_layers} layers")
        if target in FUSED["gate_up"] + FUSED["down"] and layer in cfg.sparse_layers:
            raise LoraError(f"LoRA adapter {name!r}: {key} targets a mixture-of-experts "
                            "layer's MLP, which is not supported")
        halves.setdefault((layer, target), {})[match[3]] = tensor
    shapes = target_shapes(cfg)
    weights = {}
    for (layer, target), pair in sorted(halves.items()):
        a, b = pair.get("A"), pair.get("B")
        where = f"LoRA adapter {name!r}, layer {layer} {target}"
        if a is None or b is None:
            raise LoraError(f"{where}: lora_A and lora_B must both be present")
        fan_in, fan_out = shapes[target]
        if (a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape[0] != fan_out
                or a.shape[0] != b.shape[1]):
            raise LoraError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                            f"not fit a {fan_in} -> {fan_out} projection")
        rank = a.shape[0]
        alpha = _pattern(config.get("alpha_pattern"), layer, target, config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        weights[(layer, target)] = (a.float(), b.float() * scale)
    if not weights:
        raise LoraError(f"LoRA adapter {name!r}: {file} holds no LoRA weights")
    return LoraAdapter(name, weights)


def shard_adapter(adapter: LoraAdapter, rank: int, size: int) -> LoraAdapter:
    """This tensor-parallel rank's share of an adapter, split as the base projection it
    attaches to: a column-parallel one's (q/k/v, gate/up) B by output rows, a row-parallel
    one's (o, down) A by input columns, whose partial B A x the group then sums."""
    weights = {}
    for (layer, target), (a, b) in adapter.weights.items():
        if target in COLUMN_SPLIT:
            part = a.shape[1] // size
            a = a.narrow(1, rank * part, part).contiguous()
        else:
            part = b.shape[0] // size
            b = b.narrow(0, rank * part, part).contiguous()
        weights[(layer, target)] = (a, b)
    return LoraAdapter(adapter.name, weights)


def _pattern(patterns: dict[str, float] | None, layer: int, target: str, default: float
             ) -> float:
    """A per-module value of PEFT's alpha_pattern: its key names the module by a suffix of
    its full name (or a regular expression matching such a suffix)."""
    name = module_name(layer, target)
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", name):
            return float(value)
    return float(default)


class LoraPool:
    """Every loaded adapter in host memory, and `slots` device slots holding the ones a
    step uses. Per layer and fused projection (q|k|v, o, gate|up, down) the targets of it
    that adapters may have share one A [slots, n * rank, in] (their A's stacked: one shrink
    for all of them) and one B, held transposed as bt [slots, n * rank, out]
    (block-diagonal: each target's B at its own columns of the fused output, so one expand
    writes them all); zero past an adapter's own rank and for targets it leaves alone. They
    are held in the model's dtype (float32 for float16 on the CPU) and multiplied in float32
    on the CPU: a step reads every adapter it serves, so halving their bytes for a bfloat16
    model is what serving many of them costs less by.

    A slot is taken for an adapter when a request for it is admitted and given back when
    the last one leaves; an adapter stays in its slot until the slot is needed again (least
    recently used first). A pinned adapter is copied into a slot when it is added and keeps
    it until it is removed; one slot at least stays for the others."""

    def __init__(self, adapters: dict[str, LoraAdapter], cfg: ModelConfig, slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device,
                 targets: set[str] | None = None, max_loaded: int | None = None,
                 pinned: Iterable[str] = ()) -> None:
        if slots < 1:
            raise LoraError(f"max_loras_per_batch must be at least 1, got {slots}")
        if not adapters and not (max_rank and targets):
            raise LoraError("enable_lora without lora_paths needs max_lora_rank and "
                            "lora_target_modules, which size the adapters' slots")
        self.adapters: dict[str, LoraAdapter] = {}
        self.device = device
        # Whether steps run the Triton kernels (on a GPU) or a torch pass per adapter.
        self.kernels = device.type == "cuda"
        self.max_loaded = max_loaded
        self.rank = max_rank or max(a.rank for a in adapters.values())
        self.targets = targets or {t for a in adapters.values() for t in a.targets}
        shapes = target_shapes(cfg)
        if device.type == "cpu" and dtype != torch.bfloat16:
            dtype = torch.float32
        # Each target's place: its fused projection, its A rows' start, its output columns.
        self.places: dict[str, tuple[str, int, int, int]] = {}
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.bt: dict[tuple[int, str], torch.Tensor] = {}
        for fused, parts in FUSED.items():
            held = [t for t in parts if t in self.targets]
            if not held:
                continue
            column = 0
            for target in parts:
                if target in held:
                    self.places[target] = (fused, held.index(target) * self.rank, column,
                                           shapes[target][1])
                column += shapes[target][1]
            fan_in = shapes[parts[0]][0]
            for layer in range(cfg.num_layers):
                # Slots no adapter has held yet take no memory on the CPU.
                self.a[(layer, fused)] = lazy_zeros((slots, len(held) * self.rank, fan_in),
                                                    dtype, device)
                self.bt[(layer, fused)] = lazy_zeros((slots, len(held) * self.rank, column),
                                                     dtype, device)
        # As the native CPU layers take them (kernels/native_layer.LoraArgs).
        blocks: dict[str, list[tuple[int, int, int, int]]] = {fused: [] for fused in FUSED}
        for fused, row, column, width in self.places.values():
            blocks[fused].append((column, width, row, self.rank))
        self.native_layers: list[dict[str, LoraProjection]] = [
            {fused: (self.a[(layer, fused)], self.bt[(layer, fused)], blocks[fused])
             for fused in FUSED if (layer, fused) in self.a}
            for layer in range(cfg.num_layers)
        ]
        self.slots = slots
        self.slot_loads = 0  # adapters copied into a slot, ever
        self.slot_evictions = 0  # adapters put out of their slot for another, ever
        self._held: list[str | None] = [None] * slots  # the adapter in each slot
        self._users = [0] * slots  # requests using each slot
        self._recent: OrderedDict[int, None] = OrderedDict((s, None) for s in range(slots))
        self._pinned: set[int] = set()  # the slots pinned adapters hold for good
        pinned = set(pinned)
        for adapter in adapters.values():
            self.add(adapter, adapter.name in pinned)

    @property
    def pinned(self) -> set[str]:
        """The adapters that hold a slot for good."""
        return {held for s in self._pinned if (held := self._held[s]) is not None}

    def add(self, adapter: LoraAdapter, pinned: bool = False) -> None:
        """Serve `adapter` from now on: in host memory until a request needs it, or pinned
        in a slot of its own at once."""
        name = adapter.name
        if name in self.adapters:
            raise LoraError(f"LoRA adapter {name!r} is already loaded")
        if self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            raise LoraError(f"LoRA adapter {name!r}: max_loaded_loras ({self.max_loaded}) "
                            "adapters are loaded; unload one first")
        if adapter.rank > self.rank:
            raise LoraError(f"LoRA adapter {name!r} has rank {adapter.rank}, above "
                            f"max_lora_rank {self.rank}")
        if adapter.targets - self.targets:
            raise LoraError(f"LoRA adapter {name!r} targets "
                            f"{', '.join(sorted(adapter.targets - self.targets))}, which the "
                            f"adapters' slots were not made for (lora_target_modules)")
        if pinned and len(self._pinned) >= self.slots - 1:
            raise LoraError(f"LoRA adapter {name!r} cannot be pinned: {len(self._pinned)} of "
                            f"the {self.slots} slots are, and one must stay for the others "
                            "(max_loras_per_batch)")
        self.adapters[name] = adapter
        if pinned:
            slot = self.acquire(name)
            self.release(slot)
            self._pinned.add(slot)

    def remove(self, name: str) -> None:
        """Stop serving adapter `name`. Requests still running with it keep its slot, which
        is reused only once they have left."""
        if self.adapters.pop(name, None) is None:
            raise LoraError(f"LoRA adapter {name!r} is not loaded")
        for slot, held in enumerate(self._held):
            if held == name:
                self._held[slot] = None
                self._pinned.discard(slot)

    def acquire(self, name: str) -> int:
        """The slot holding adapter `name` for one more request, copied in if need be."""
        if name not in self.adapters:
            raise LoraError(f"LoRA adapter {name!r} is not loaded")
        slot = next((s for s, held in enumerate(self._held) if held == name), None)
        if slot is None:
            slot = next((s for s in self._recent
                         if not self._users[s] and s not in self._pinned), None)
            if slot is None:
                raise LoraError(f"no LoRA slot is free for {name!r}: every one of the "
                                f"{len(self._held)} is in use")
            self.slot_evictions += self._held[slot] is not None
            self._copy_in(slot, self.adapters[name])
            self._held[slot] = name
            self.slot_loads += 1
        self._users[slot] += 1
        self._recent.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        """A request using `slot` has left."""
        self._users[slot] -= 1

    def reset(self) -> None:
        """No request uses any slot (the scheduler started over); adapters stay in them."""
        self._users = [0] * len(self._users)

    def in_use(self) -> bool:
        """Whether any request runs with an adapter."""
        return any(self._users)

    def _copy_in(self, slot: int, adapter: LoraAdapter) -> None:
        for key, a in self.a.items():
            a[slot].zero_()
            self.bt[key][slot].zero_()
        for (layer, target), (a, b) in adapter.weights.items():
            fused, row, column, width = self.places[target]
            rank = a.shape[0]
            self.a[(layer, fused)][slot, row : row + rank].copy_(a)
            self.bt[(layer, fused)][slot, row : row + rank, column : column + width].copy_(b.T)


class LoraBatch:
    """One step's adapters, from each token's slot, in the form its path reads them (each
    made on first use): on a GPU the tokens sorted by adapter for the segmented kernels
    (radixmesh.kernels.lora), in the native CPU layers the same order as LoraArgs, else each
    adapter's rows for one torch pass per adapter."""

    def __init__(self, pool: LoraPool, token_slots: torch.Tensor) -> None:
        self.pool = pool
        self.token_slots = token_slots.to(pool.device)

    @cached_property
    def aligned(self) -> AlignedPicks:
        from radixmesh.kernels.lora import align_tokens

        return align_tokens(self.token_slots, self.pool.slots, KERNEL_BLOCK_M)

    @cached_property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        used = [s for s in torch.unique(self.token_slots).tolist() if s >= 0]
        return [(s, (self.token_slots == s).nonzero().flatten()) for s in used]

    def native_args(self) -> LoraArgs:
        """The step's adapters as the native CPU layers take them."""
        slots = self.token_slots.to(torch.int32)
        order = torch.argsort(slots, stable=True)[int((slots < 0).sum()):].to(torch.int32)
        return LoraArgs(self.pool.native_layers, slots, order)

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += B (A x) for each adapter's rows, over the fused projection `fused` (x:
        its input, out: its output)."""
        pool = self.pool
        a = pool.a.get((layer, fused))
        if a is None:
            return
        bt = pool.bt[(layer, fused)]
        if pool.kernels:
            from radixmesh.kernels.lora import lora_add

            lora_add(x, a, bt.transpose(1, 2), self.token_slots, out, self.aligned,
                     KERNEL_BLOCK_M)
            return
        # float32: torch's bfloat16 products of these thin shapes are 2-4x slower on the CPU.
        x = x.float()
        if len(self.groups) == 1 and self.groups[0][1].numel() == x.shape[0]:
            slot = self.groups[0][0]  # one adapter for every token: no gather, no scatter
            out += ((x @ a[slot].T.float()) @ bt[slot].float()).to(out.dtype)
            return
        for slot, rows in self.groups:
            delta = (x.index_select(0, rows) @ a[slot].T.float()) @ bt[slot].float()
            out.index_add_(0, rows, delta.to(out.dtype))


def lora_pool(settings: LoraSettings, config: ModelConfig, dtype: torch.dtype,
              device: torch.device, tp: TensorParallel | None = None) -> LoraPool:
    """The adapters of `settings` loaded and checked against the model, in their pool (this
    tensor-parallel rank's share of each, with `tp`)."""
    if config.is_hybrid:
        raise LoraError(f"{config.architecture}: LoRA adapters on a hybrid linear-attention "
                        "model are not supported")
    refs = parse_lora_paths(settings.lora_paths)
    adapters = {ref.name: rank_share(load_adapter(ref.name, ref.path, config), tp)
                for ref in refs}
    allowed = settings.lora_target_modules
    targets = None
    if allowed:
        targets = set(TARGETS) if allowed == "all" else {
            t.strip() for t in allowed.split(",") if t.strip()}
        if targets - set(TARGETS):
            raise LoraError(f"lora_target_modules: unknown {sorted(targets - set(TARGETS))}; "
                            f"choose among {', '.join(TARGETS)} or all")
    shape = config if tp is None else local_config(config, tp.size)
    return LoraPool(adapters, shape, settings.max_loras_per_batch, settings.max_lora_rank,
                    dtype, device, targets, settings.max_loaded_loras,
                    [ref.name for ref in refs if ref.pinned])


def rank_share(adapter: LoraAdapter, tp: TensorParallel | None) -> LoraAdapter:
    """The adapter as this tensor-parallel rank holds it (all of it without `tp`)."""
    return adapter if tp is None else shard_adapter(adapter, tp.rank, tp.size)
