"""The hybrid linear-attention families (Qwen3-Next, Qwen3.5 dense and MoE): tiny random
checkpoints greedy-identical to transformers in float32 through the Engine, batched and
alone, in small prefill chunks and whole, at page sizes 1, 2 and 4, with overlap on and off;
cached prefixes resumed from snapshots of the linear layers' state (a repeated prompt, a
prompt branching off another, the second turn of a chat after an answer cut by its length
or by a stop token), as many tokens cached as the snapshots cover and the same tokens as a
cold run; snapshots evicted leaf first from a tiny pool; a Qwen3.5 checkpoint with a vision
tower served as its text model; the gated delta rule's blocks against its token-by-token
recurrence (and transformers'); Qwen3-Next's projections brought to Qwen3.5's layout; the
state pool's accounting and its slots and snapshots coming back after requests finish or
are aborted and the cache is flushed; and what a hybrid model refuses to run with."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import in_thread
from process_helpers import mesh_answers
from test_model_vs_hf import greedy
from tiny_model import hf_greedy, save_with_word_tokenizer, spread_weights

from radixmesh.api import Engine
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.settings import EngineArgs
from radixmesh.core.step import NewRequest, StateSave, StepBatch, StepEntry
from radixmesh.engine.model.linear_attention import chunk_rule, l2_normalize, recurrent_step
from radixmesh.engine.model.lora import LoraError
from radixmesh.engine.model.memory import Memory
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.parallel import check_divisible
from radixmesh.engine.model.pool_size import auto_pool_size, size_pool
from radixmesh.engine.model.runner import ModelRunner
from radixmesh.engine.model.state_pool import StatePool, request_state_bytes
from radixmesh.engine.scheduler_config import SchedulerConfig

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 256, 64, 4, 2, 16
# Two q/k heads of 8 serving four v heads of 16: a shape where swapping any two of them, or
# of the q/k and v head widths, changes the result.
LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
          "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
L, A = "linear_attention", "full_attention"
# Qwen3-Next: experts with a shared one in every layer but layer 1 (a dense MLP there).
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_next": {"layer_types": [L, L, A, L, A], "intermediate_size": 96, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]},
    "qwen3_5_text": {"layer_types": [L, A, L, A], "intermediate_size": 96},
    "qwen3_5_moe_text": {"layer_types": [L, L, A, L, A], "num_experts": 4,
                         "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "shared_expert_intermediate_size": 48},
}
# The 70-token prompt outgrows one 64-token block of the delta rule when prefilled whole.
PROMPTS = [[(7 * i + 3 * p + 1) % VOCAB for i in range(n)] for p, n in enumerate((37, 5, 70, 1))]
# The third prompt's first 40 tokens, then others: a prefix another request computed.
BRANCH = PROMPTS[2][:40] + [(5 * i + 11) % VOCAB for i in range(9)]
NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
MODES: dict[str, dict[str, Any]] = {
    "chunks_of_16": {"chunked_prefill_size": 16, "page_size": 1},
    "chunks_of_5_page_4_no_overlap": {"chunked_prefill_size": 5, "page_size": 4,
                                      "disable_overlap_schedule": True},
    "whole_prompts_page_2": {"chunked_prefill_size": 512, "page_size": 2},
}


def hf_text_config(family: str, context: int = 256) -> Any:
    config_cls = {"qwen3_next": transformers.Qwen3NextConfig,
                  "qwen3_5_text": transformers.Qwen3_5TextConfig,
                  "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig}[family]
    fields = FAMILIES[family]
    return config_cls(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=len(fields["layer_types"]),
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=context, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
        pad_token_id=0, **LINEAR, **fields,
    )


def spread(model: Any) -> Any:
    """`model` with every weight redrawn (from seed 0) so that each matters, in eval mode."""
    torch.manual_seed(0)
    spread_weights(model, router_scale=4.0)
    return model.eval()


class Saved(NamedTuple):
    """A family's transformers model, its checkpoint with a word-level tokenizer, and the
    model's greedy tokens for each of PROMPTS and for BRANCH."""

    family: str
    model: Any
    path: Path
    refs: list[list[int]]
    branch_ref: list[int]


def build(family: str, directory: Path, context: int = 256) -> Saved:
    """A random `family` model saved in `directory`, and its greedy tokens."""
    model = spread(transformers.AutoModelForCausalLM.from_config(
        hf_text_config(family, context)))
    path = save_with_word_tokenizer(model, directory / "model")
    refs = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    assert len({t for ref in refs for t in ref}) > NEW_TOKENS  # the model says something
    return Saved(family, model, path, refs, hf_greedy(model, BRANCH, NEW_TOKENS))


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory) -> Saved:
    return build(request.param, tmp_path_factory.mktemp(request.param))


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether `condition()` holds within `timeout` seconds (a step releases what the one
    before finished)."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def all_returned(engine: Engine) -> bool:
    """Once the cache is flushed: every state slot, snapshot slot and KV slot free."""
    if not engine.flush_cache():
        return False
    info = engine.server_info()
    states = engine.runner.states
    return (states.free_slots == states.num_slots and info["free_slots"] == info["num_slots"]
            and info["cached_tokens"] == 0 and info["cached_snapshots"] == 0
            and info["free_snapshots"] == info["num_snapshots"] == states.num_snapshots > 0)


def aligned(tokens: int, mode: str) -> int:
    """`tokens` cut back to a whole number of the mode's pages."""
    page = MODES[mode]["page_size"]
    return tokens - tokens % page


def generate(engine: Engine, ids: list[int], **params: Any) -> tuple[list[int], int]:
    """One prompt's greedy output ids and its cached tokens."""
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, **params})
    assert isinstance(out, dict)
    return out["output_ids"], out["meta_info"]["cached_tokens"]


# ---- through the Engine, against transformers ---------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_greedy_matches_transformers(saved: Saved, mode: str) -> None:
    """The four prompts at once, token-identical to transformers; then, the cache flushed,
    each alone twice: computed from the start, then from the snapshot of the state at the
    last page boundary before its last token (the tokens before it cached), the same tokens
    both times; then a prompt sharing the third's first 40 tokens, from the deepest
    snapshot the third's prefill took on them (at its chunks' page boundaries); every slot
    and snapshot back once the cache is flushed."""
    family, _, path, refs, branch_ref = saved
    chunk = MODES[mode]["chunked_prefill_size"]
    with Engine(str(path), dtype="float32", max_total_tokens=512, show_progress=False,
                **MODES[mode]) as engine:
        assert engine.model_config.architecture == family
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert isinstance(outs, list)
        assert [o["output_ids"] for o in outs] == refs
        assert engine.flush_cache()
        for ids, ref in zip(PROMPTS, refs, strict=True):
            assert generate(engine, ids) == (ref, 0)
            assert generate(engine, ids) == (ref, aligned(len(ids) - 1, mode))
        third = len(PROMPTS[2])
        taken = [aligned(end, mode) for end in range(chunk, third, chunk)]
        taken.append(aligned(third - 1, mode))
        assert generate(engine, BRANCH) == (branch_ref, max(t for t in [0, *taken] if t <= 40))
        assert wait_for(lambda: all_returned(engine))


# The new message of a chat's second turn, after the first turn's prompt and answer.
MESSAGE = [(13 * i + 5) % VOCAB for i in range(6)]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_second_chat_turn_resumes_after_the_first(saved: Saved, mode: str) -> None:
    """A chat's second turn (the first turn's prompt and answer, then a new message) starts
    from the snapshot the first turn left at the end of what it fed the model: its answer
    cut by the length limit (its last token never fed), or by a stop token, whose decode an
    overlapped scheduler has already run when it learns of the stop (then fed too). Cached
    tokens are exactly that, page-aligned; the tokens are transformers' and a cold run's."""
    page = MODES[mode]["page_size"]
    overlap = not MODES[mode].get("disable_overlap_schedule", False)
    answer = saved.refs[2]
    stop = next(k for k in range(3, NEW_TOKENS) if answer[k] not in answer[:k])
    with Engine(str(saved.path), dtype="float32", max_total_tokens=512, show_progress=False,
                **MODES[mode]) as engine:
        first, _ = generate(engine, PROMPTS[0])
        stopped, _ = generate(engine, PROMPTS[2], stop_token_ids=[answer[stop]])
        assert (first, stopped) == (saved.refs[0], answer[: stop + 1])
        turns = [(PROMPTS[0] + first + MESSAGE, len(PROMPTS[0]) + NEW_TOKENS - 1),
                 (PROMPTS[2] + stopped + MESSAGE, len(PROMPTS[2]) + stop + overlap)]
        expected = [hf_greedy(saved.model, ids, NEW_TOKENS) for ids, _ in turns]
        for (ids, fed), ref in zip(turns, expected, strict=True):
            assert generate(engine, ids) == (ref, fed - fed % page)
        assert engine.flush_cache()
        for (ids, _), ref in zip(turns, expected, strict=True):
            assert generate(engine, ids) == (ref, 0)
        assert wait_for(lambda: all_returned(engine))


def test_snapshots_are_evicted_leaf_first_from_a_tiny_pool(tmp_path) -> None:
    """One running request, so two snapshot slots. A prompt's run keeps the snapshot before
    its prompt's last token and the one at the end of its answer, below it; a request that
    needs a slot takes the deeper one first (leaf first, its KV with it), and one holding
    both on its own path gets none. Every answer is transformers'."""
    saved = build("qwen3_5_text", tmp_path)
    a, b, c = PROMPTS[0], PROMPTS[2], PROMPTS[3]
    a_ref, b_ref, c_ref = saved.refs[0], saved.refs[2], saved.refs[3]
    with Engine(str(saved.path), dtype="float32", max_total_tokens=512, show_progress=False,
                max_running_requests=1, chunked_prefill_size=512) as engine:
        assert (engine.server_info()["num_snapshots"], engine.runner.states.num_snapshots) == (
            2, 2)
        assert generate(engine, a) == (a_ref, 0)
        assert engine.server_info()["cached_snapshots"] == 2
        # Both snapshots are on its own path, locked: its answer's end gets none.
        follow = a + a_ref
        fed = len(a) + NEW_TOKENS - 1
        assert generate(engine, follow) == (hf_greedy(saved.model, follow, NEW_TOKENS), fed)
        # c's answer takes the slot of a's deeper snapshot; a's prompt keeps its own.
        assert generate(engine, c) == (c_ref, 0)
        assert generate(engine, a) == (a_ref, len(a) - 1)
        # b takes both of a's, the deeper first.
        assert generate(engine, b) == (b_ref, 0)
        assert generate(engine, b) == (b_ref, len(b) - 1)
        assert generate(engine, a) == (a_ref, 0)
        assert engine.server_info()["cached_snapshots"] == 2
        assert wait_for(lambda: all_returned(engine))


def test_the_mesh_serves_qwen3_next(tmp_path) -> None:
    """Through the mesh's processes (the scheduler learns the family and its snapshot slots
    from its worker): the same tokens, the third prompt twice, the second time from the
    snapshot of its state before its last token."""
    saved = build("qwen3_next", tmp_path)
    prompts = [*PROMPTS[:3], PROMPTS[2]]
    info, answers = mesh_answers(saved.path, tmp_path / "logs", prompts, GREEDY)
    assert info["architecture"] == "qwen3_next"
    assert [a["output_ids"] for a in answers] == [*saved.refs[:3], saved.refs[2]]
    assert [a["meta_info"]["cached_tokens"] for a in answers] == [0, 0, 0, len(PROMPTS[2]) - 1]


def test_logprob_requests_decode_beside_packed_ones(saved: Saved) -> None:
    """Requests that report logprobs (each decode an entry of its own) beside plain ones
    (packed decodes): the same tokens, each output logprob transformers' log-softmax."""
    with Engine(str(saved.path), dtype="float32", max_total_tokens=512,
                chunked_prefill_size=16, show_progress=False) as engine:
        reporting = in_thread(engine.generate, input_ids=PROMPTS[:2], sampling_params=GREEDY,
                              return_logprob=True)
        plain = engine.generate(input_ids=PROMPTS[2:], sampling_params=GREEDY)
        outs = [*reporting.result(timeout=60), *plain]
    assert [o["output_ids"] for o in outs] == saved.refs
    for ids, out in zip(PROMPTS[:2], outs, strict=False):
        sequence = ids + out["output_ids"]
        with torch.inference_mode():
            logits = saved.model(torch.tensor([sequence[:-1]])).logits[0, len(ids) - 1 :]
        expected = logits.log_softmax(-1).gather(1, torch.tensor(out["output_ids"])[:, None])
        ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(ours), expected[:, 0], rtol=1e-4, atol=1e-4)


def test_retracted_requests_resume_from_their_snapshots(tmp_path) -> None:
    """A pool too small for four requests at once: those retracted for room come back from
    the snapshot of their state taken as they left (their prompt and output so far cached)
    and still answer transformers' tokens."""
    saved = build("qwen3_5_text", tmp_path)
    steps = 40
    refs = [hf_greedy(saved.model, ids, steps) for ids in PROMPTS]
    with Engine(str(saved.path), dtype="float32", max_total_tokens=192, chunked_prefill_size=16,
                show_progress=False) as engine:
        states = engine.runner.states
        admitted: list[tuple[int, int]] = []  # (cached prefix, snapshot) of each admission
        admit = states.admit

        def spy(row: int, prefix: int = 0, snapshot: int = -1) -> None:
            admitted.append((prefix, snapshot))
            admit(row, prefix, snapshot)

        states.admit = spy  # type: ignore[method-assign]
        outs = engine.generate(input_ids=PROMPTS,
                               sampling_params={**GREEDY, "max_new_tokens": steps})
        assert engine.server_info()["num_retractions"] > 0
        assert [o["output_ids"] for o in outs] == refs
        assert any(prefix > 0 and snapshot >= 0 for prefix, snapshot in admitted)
        assert wait_for(lambda: all_returned(engine))


def test_aborted_requests_give_their_slots_back(tmp_path) -> None:
    """Requests aborted while they decode give their state and KV slots back; the rows they
    leave start the next requests from a zero state (transformers' tokens)."""
    saved = build("qwen3_5_text", tmp_path, context=8192)
    # Far more tokens than they get to: aborted, never finished.
    long = {"max_new_tokens": 8000, "temperature": 0, "ignore_eos": True}
    with Engine(str(saved.path), dtype="float32", max_total_tokens=16384, chunked_prefill_size=8,
                max_running_requests=4, show_progress=False) as engine:
        states = engine.runner.states
        assert (states.num_slots, states.free_slots) == (4, 4)
        chunks = engine.generate(input_ids=PROMPTS[0], sampling_params=long, rid="streamed",
                                 stream=True)
        next(chunks)  # decoding now
        blocking = in_thread(engine.generate, input_ids=PROMPTS[2], sampling_params=long,
                             rid="blocking")
        assert wait_for(lambda: states.free_slots == 2)
        engine.abort("streamed")
        engine.abort("blocking")
        assert blocking.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"
        assert list(chunks)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert wait_for(lambda: all_returned(engine))
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == saved.refs
        assert wait_for(lambda: all_returned(engine))


@pytest.mark.parametrize("tied", [False, True])
def test_a_checkpoint_with_a_vision_tower_serves_its_text_model(tmp_path, tied: bool) -> None:
    """Qwen3.5 as released: config.json nests the text model's config beside the vision
    tower's, the weights sit under model.language_model and model.visual; the text model
    answers as transformers' multimodal model does for text alone. The multimodal model's
    own tie_word_embeddings ties its lm_head, whatever its text config says."""
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": HIDDEN, "patch_size": 4, "num_position_embeddings": 16}
    config = transformers.Qwen3_5Config(
        text_config=hf_text_config("qwen3_5_text").to_dict(), vision_config=vision,
        image_token_id=250, video_token_id=251, vision_start_token_id=252,
        vision_end_token_id=253, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = spread(transformers.Qwen3_5ForConditionalGeneration(config))
    path = save_with_word_tokenizer(model, tmp_path / "model")
    ids = PROMPTS[0]
    with Engine(str(path), dtype="float32", max_total_tokens=256, show_progress=False) as engine:
        assert engine.model_config.architecture == "qwen3_5_text"
        out = engine.generate(input_ids=ids, sampling_params=GREEDY)
        assert isinstance(out, dict)
        assert out["output_ids"] == hf_greedy(model, ids, NEW_TOKENS)


def test_the_worker_saves_and_restores_states_inside_a_step(tmp_path) -> None:
    """Through the runner's StepBatch: a 50-token prompt fed in one entry saves its state
    after 23 tokens (the delta rule split there) and after all 50; a decode saves the state
    after its token. Each snapshot is the state that feeding those tokens alone leaves, and a
    request admitted from the first one with the first 23 tokens cached continues to the
    same state and the same greedy tokens."""
    torch.manual_seed(0)
    model = spread(transformers.AutoModelForCausalLM.from_config(hf_text_config("qwen3_next")))
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), progress=False)
    runner = ModelRunner(loaded.config, loaded.weights, torch.float32, num_slots=256)
    states, prompt = runner.states, PROMPTS[2][:50]
    greedy_params = SamplingParams(temperature=0)

    def new(rid: str, row: int, prefix: int = 0, snapshot: int = -1) -> NewRequest:
        return NewRequest(rid, row, prompt[:prefix], list(range(prefix)), len(prompt),
                          greedy_params, 0, snapshot=snapshot)

    def state(row: int, slot: int = -1) -> list[torch.Tensor]:
        if slot >= 0:
            return [t[slot] for t in (*states.saved_conv, *states.saved_recurrent)]
        return [t[row].clone() for t in (*states.conv, *states.recurrent)]

    def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)

    entry = StepEntry("a", prompt, list(range(50)), True)
    whole = runner.forward(StepBatch(1, [new("a", 0)], [entry],
                                     saves=[StateSave(0, 23, 0), StateSave(0, 50, 1)]))
    after_50 = state(0)
    close(state(0, 1), after_50)
    runner.forward(StepBatch(2, [new("b", 1)],
                             [StepEntry("b", prompt[:23], list(range(50, 73)), False)]))
    close(state(0, 0), state(1))
    decode = StepBatch(3, release=["b"], saves=[StateSave(0, 1, 2)])
    decode.decode_rows.append(0)
    decode.decode_slots.append(73)
    token = runner.forward(decode).decode_tokens[0]
    close(state(0, 2), state(0))
    resumed = runner.forward(StepBatch(4, [new("c", 1, 23, 0)],
                                       [StepEntry("c", prompt[23:], list(range(80, 107)), True)]))
    close(state(1), after_50)
    assert resumed.results[0].token_id == whole.results[0].token_id
    assert [whole.results[0].token_id, token] == hf_greedy(model, prompt, 2)


def test_gated_attention_with_biases(tmp_path) -> None:
    """attention_bias: q_proj's bias split between the queries and the output gate as its
    rows are, and o_proj's bias too."""
    config = hf_text_config("qwen3_next")
    config.attention_bias = True
    torch.manual_seed(0)
    model = spread(transformers.AutoModelForCausalLM.from_config(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), progress=False)
    runner = ModelRunner(loaded.config, loaded.weights, torch.float32, num_slots=256)
    assert greedy(runner, PROMPTS[2], NEW_TOKENS) == hf_greedy(model, PROMPTS[2], NEW_TOKENS)


# ---- the layer --------------------------------------------------------------------------


def random_rule_inputs(tokens: int, heads: int = 3, dk: int = 8, dv: int = 5, seed: int = 0
                       ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(heads, tokens, dk, generator=g)) * dk**-0.5
    k = l2_normalize(torch.randn(heads, tokens, dk, generator=g))
    v = torch.randn(heads, tokens, dv, generator=g)
    decay = -3 * torch.rand(heads, tokens, generator=g)
    beta = torch.rand(heads, tokens, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_rule_equals_the_recurrence(chunk: int) -> None:
    """150 tokens from a nonzero state in blocks of `chunk`: each output and the final state
    as stepping token by token gives them."""
    q, k, v, decay, beta, state = random_rule_inputs(150)
    out, final = chunk_rule(q, k, v, decay, beta, state, chunk)
    step_state = state.unsqueeze(0)
    for t in range(150):
        o, step_state = recurrent_step(q[None, :, t], k[None, :, t], v[None, :, t],
                                       decay[None, :, t], beta[None, :, t], step_state)
        torch.testing.assert_close(out[:, t], o[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, step_state[0], rtol=1e-5, atol=1e-5)


def test_chunked_rule_matches_transformers() -> None:
    """Ours against transformers' torch reference from the same nonzero state (its inputs
    [batch, tokens, heads, dim], normalising q and k itself)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    g = torch.Generator().manual_seed(3)
    heads, tokens, dk, dv = 2, 90, 8, 4
    q, k = torch.randn(2, 1, tokens, heads, dk, generator=g).unbind(0)
    v = torch.randn(1, tokens, heads, dv, generator=g)
    decay, beta = -2 * torch.rand(1, tokens, heads, generator=g), torch.rand(1, tokens, heads,
                                                                              generator=g)
    state = torch.randn(1, heads, dk, dv, generator=g)
    theirs, their_state = torch_chunk_gated_delta_rule(
        q, k, v, decay, beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    ours, our_state = chunk_rule(
        l2_normalize(q[0].transpose(0, 1)) * dk**-0.5, l2_normalize(k[0].transpose(0, 1)),
        v[0].transpose(0, 1), decay[0].t(), beta[0].t(), state[0])
    torch.testing.assert_close(ours.transpose(0, 1), theirs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_state, their_state[0], rtol=1e-5, atol=1e-5)


def test_qwen3_next_projections_take_qwen3_5s_layout(tmp_path) -> None:
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (rows grouped by q/k head) loaded as in_proj_
    qkv, _z, _b, _a: the same q, k, v, z, b and a as transformers derives from them."""
    torch.manual_seed(0)
    model = spread(transformers.AutoModelForCausalLM.from_config(hf_text_config("qwen3_next")))
    model.save_pretrained(tmp_path)
    weights = load_model(str(tmp_path), progress=False).weights
    assert not any("in_proj_qkvz" in name or "in_proj_ba" in name for name in weights)
    layer = model.model.layers[0].linear_attn
    x = torch.randn(1, 3, HIDDEN)
    with torch.no_grad():
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x),
                                                              layer.in_proj_ba(x))
    ours = {p: F.linear(x[0], weights[f"model.layers.0.linear_attn.in_proj_{p}.weight"])
            for p in ("qkv", "z", "b", "a")}
    expected_qkv = torch.cat([t[0].reshape(3, -1) for t in (q, k, v)], dim=-1)
    torch.testing.assert_close(ours["qkv"], expected_qkv)
    torch.testing.assert_close(ours["z"], z[0].reshape(3, -1))
    torch.testing.assert_close(ours["b"], b[0])
    torch.testing.assert_close(ours["a"], a[0])


# ---- the config and the pools ---------------------------------------------------------------


def hybrid_dict(model_type: str, **fields: Any) -> dict[str, Any]:
    return {"model_type": model_type, "vocab_size": 8, "hidden_size": 64,
            "intermediate_size": 32, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, **LINEAR, **fields}


def test_hybrid_config_fields() -> None:
    """The layer pattern from full_attention_interval when layer_types is absent; each
    layer's place in its pool; partial rotary's default quarter; Qwen3.5's nested text
    config (its multimodal rotary plain for text) and Qwen3.5-MoE's all-sparse layers."""
    nxt = ModelConfig.from_hf_dict(hybrid_dict(
        "qwen3_next", full_attention_interval=3, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=[0]))
    assert nxt.linear_layers == (0, 1, 3, 4) and nxt.num_kv_layers == 2
    assert [nxt.mixer_index(i) for i in range(6)] == [0, 1, 0, 2, 3, 1]
    assert (nxt.rope_dim, nxt.attn_output_gate, nxt.qk_norm) == (8, True, True)
    assert nxt.sparse_layers == (1, 2, 3, 4, 5) and nxt.norm_topk_prob
    assert nxt.shared_expert_intermediate_size == 24
    assert nxt.linear is not None and nxt.linear.conv_dim == 2 * 2 * 8 + 4 * 16
    text = hybrid_dict("qwen3_5_text", layer_types=[L, L, A, L, L, A],
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                        "partial_rotary_factor": 0.5, "mrope_interleaved": True,
                                        "mrope_section": [2, 1, 1]})
    qwen35 = ModelConfig.from_hf_dict({"model_type": "qwen3_5", "text_config": text,
                                       "vision_config": {"depth": 2}})
    assert qwen35.architecture == "qwen3_5_text" and qwen35.linear_layers == (0, 1, 3, 4)
    assert (qwen35.rope_dim, qwen35.rope_theta, qwen35.rope_scaling) == (16, 1e6, None)
    assert not qwen35.is_moe
    moe_text = {k: v for k, v in hybrid_dict("qwen3_5_moe_text").items()
                if k != "intermediate_size"}
    moe = ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe", "text_config": {
        **moe_text, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24}})
    assert moe.architecture == "qwen3_5_moe_text" and moe.linear_layers == (0, 1, 2, 4, 5)
    assert moe.sparse_layers == tuple(range(6)) and moe.norm_topk_prob
    assert moe.intermediate_size == 0
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict(hybrid_dict("qwen3_5_text", layer_types=[L, A]))


def test_the_kv_pool_holds_attention_alone_and_the_state_pool_is_budgeted(caplog) -> None:
    """Bytes a token takes in the KV pool (its two attention layers only) and a request in
    the state pool (conv columns in the model's dtype, the recurrent state in float32); the
    state pool keeps two snapshot slots a running request; the memory rule takes the state
    pool out first; the start line reports both. A snapshot restores a row's state, and a
    request with a cached prefix needs one."""
    config = ModelConfig.from_hf_dict(hybrid_dict("qwen3_5_text",
                                                  layer_types=[L, L, A, L, L, A]))
    token = 2 * 2 * KV_HEADS * 32 * 2  # K and V, 2 layers, bfloat16
    state = 4 * ((2 * 2 * 8 + 4 * 16) * 3 * 2 + 4 * 8 * 16 * 4)
    assert request_state_bytes(config, torch.bfloat16) == state
    with caplog.at_level("INFO", logger="radixmesh.worker"):
        size = size_pool(EngineArgs(max_total_tokens=1024, max_running_requests=8), config,
                         torch.bfloat16, torch.device("cpu"))
    assert (size.tokens, size.token_bytes, size.state_slots, size.snapshot_slots,
            size.state_bytes) == (1024, token, 8, 16, state)
    assert f"state pool: 8 requests + 16 snapshots x {state:,} bytes" in caplog.text
    assert f"1,024 tokens x {token:,} bytes" in caplog.text
    args = EngineArgs(max_running_requests=8)
    memory = Memory(100_000_000, 50_000_000)
    budget = 50_000_000 - int((1 - 0.85) * 100_000_000)
    assert auto_pool_size(args, 256, token, memory, False).tokens == budget // token
    hybrid = auto_pool_size(args, 256, token, memory, False, state_bytes=state)
    assert hybrid.tokens == (budget - 3 * 8 * state) // token
    assert "once the state pool's" in hybrid.reason and hybrid.state_slots == 8
    pool = StatePool(config, 2, torch.bfloat16, snapshots=3)
    pool.admit(5)  # past its slots: grown
    assert (pool.num_slots, pool.free_slots, pool.num_snapshots) == (6, 5, 3)
    assert pool.recurrent[0].shape == (6, 4, 8, 16) and pool.conv[3].shape == (6, 96, 3)
    assert pool.saved_recurrent[0].shape == (3, 4, 8, 16) and pool.saved_conv[3].shape == (
        3, 96, 3)
    with pytest.raises(ValueError, match="cached prefix"):
        pool.admit(0, prefix=4)
    for layer in range(4):
        pool.conv[layer][5].normal_()
        pool.recurrent[layer][5].normal_()
    pool.save(5, 2)
    pool.admit(1, prefix=4, snapshot=2)
    for layer in range(4):
        assert torch.equal(pool.conv[layer][1], pool.conv[layer][5])
        assert torch.equal(pool.recurrent[layer][1], pool.recurrent[layer][5])
    with pytest.raises(ValueError, match="snapshot slot 3"):
        pool.save(5, 3)


# ---- what a hybrid model refuses ---------------------------------------------------------


def test_what_a_hybrid_model_refuses() -> None:
    """Speculative decoding, prefill/decode disaggregation and the hierarchical cache at
    start, each named; tensor parallelism and LoRA where the model is built."""
    def scheduler(architecture: str, mode: str = "null", **settings: Any) -> SchedulerConfig:
        return SchedulerConfig.from_settings(EngineArgs(**settings), 1, 64, 256, [], "",
                                             architecture, mode)

    assert scheduler("qwen3_next").hybrid
    assert not scheduler("qwen3", "prefill", speculative_algorithm="NGRAM").hybrid
    for mode, settings, named in (
        ("null", {"speculative_algorithm": "NGRAM"}, "speculative_algorithm NGRAM"),
        ("prefill", {}, "disaggregation_mode prefill"),
        ("decode", {"enable_hierarchical_cache": True},
         "disaggregation_mode decode or enable_hierarchical_cache"),
    ):
        with pytest.raises(ValueError, match=f"qwen3_5_text is a hybrid .* with {named}$"):
            scheduler("qwen3_5_text", mode, **settings)
    config = ModelConfig.from_hf_dict(hybrid_dict("qwen3_5_text"))
    with pytest.raises(ValueError, match="tensor-parallel"):
        check_divisible(config, 2)


def test_an_engine_refuses_speculation_and_lora_on_a_hybrid_model(tmp_path) -> None:
    torch.manual_seed(0)
    model = spread(transformers.AutoModelForCausalLM.from_config(hf_text_config("qwen3_5_text")))
    path = save_with_word_tokenizer(model, tmp_path / "model")
    with pytest.raises(ValueError, match="speculative_algorithm NGRAM"):
        Engine(str(path), dtype="float32", max_total_tokens=256, show_progress=False,
               speculative_algorithm="NGRAM")
    with pytest.raises(LoraError, match="hybrid"):
        Engine(str(path), dtype="float32", max_total_tokens=256, show_progress=False,
               enable_lora=True)
