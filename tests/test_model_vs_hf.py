"""The worker's model against Hugging Face transformers on the same weights (float32)."""

from __future__ import annotations

import pytest
import torch
from tiny_model import (
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    LAYERS,
    VOCAB,
    hf_config,
    random_hf_model,
)

from radixmesh.core.model_files import default_model_path
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.step import NewRequest, StepBatch, StepEntry
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.runner import ModelRunner

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived",
]


def greedy(runner: ModelRunner, prompt_ids: list[int], steps: int) -> list[int]:
    """Greedy tokens through the runner's StepBatch interface."""
    n = len(prompt_ids)
    batch = StepBatch(
        1,
        new_requests=[NewRequest("r", 0, [], [], n, SamplingParams(temperature=0), 0)],
        entries=[StepEntry("r", prompt_ids, list(range(n)), True)],
    )
    out = [runner.forward(batch).results[0].token_id]
    for i in range(steps - 1):
        step = StepBatch(i + 2, entries=[StepEntry("r", [], [n + i], True)])
        out.append(runner.forward(step).results[0].token_id)
    return out


def runner_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits of every position of a prompt, computed by the runner's model."""
    from radixmesh.engine.model.attention import AttentionMetadata, SeqSpan

    slots = torch.arange(len(ids))
    runner.attention.prepare(AttentionMetadata.from_spans(slots, (SeqSpan(0, len(ids), slots),)))
    with torch.inference_mode():
        hidden = runner.model.forward(torch.tensor(ids), slots, runner.attention, runner.pool)
        return runner.model.logits(hidden)


def hf_greedy(model, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Hugging Face's reference for a prompt: its greedy `steps` tokens (no eos stop) and the
    logits of every prompt position."""
    with torch.inference_mode():
        tokens = model.generate(
            torch.tensor([ids]),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
        logits = model(torch.tensor([ids])).logits[0]
    return tokens, logits


@pytest.fixture(scope="module")
def hf_smollm2():
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def test_smollm2_greedy_matches_hf(smollm2, hf_smollm2) -> None:
    from radixmesh.core.tokenizer import Tokenizer

    tok = Tokenizer.from_path(None)
    runner = ModelRunner(smollm2.config, smollm2.weights, torch.float32, num_slots=512)
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        ref, ref_logits = hf_greedy(hf_smollm2, ids, 24)
        runner.requests.clear()
        ours = greedy(runner, ids, 24)
        assert ours == ref, f"prompt {i}: {ours} != {ref}"
        torch.testing.assert_close(runner_logits(runner, ids), ref_logits, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("llama", {"tie_word_embeddings": False, "rope_theta": 10000.0}),
        (
            "llama",
            {
                "tie_word_embeddings": True,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
        ),
        ("qwen2", {"tie_word_embeddings": False}),
        ("qwen3", {"tie_word_embeddings": True, "head_dim": 32}),
    ],
)
def test_tiny_random_models_match_hf(tmp_path, kind: str, extra: dict) -> None:
    config = hf_config(
        kind, VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, max_position_embeddings=256,
        **extra,
    )
    hf = random_hf_model(config)
    with torch.no_grad():  # random biases so Qwen2's q/k/v bias path is exercised
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), progress=False)
    assert isinstance(loaded.config, ModelConfig)
    runner = ModelRunner(loaded.config, loaded.weights, torch.float32, num_slots=256)
    ids = [int(t) for t in torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1))]
    ref, ref_logits = hf_greedy(hf, ids, 12)
    torch.testing.assert_close(runner_logits(runner, ids), ref_logits, atol=1e-4, rtol=1e-4)
    runner.requests.clear()
    assert greedy(runner, ids, 12) == ref
