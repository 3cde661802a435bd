"""Decoder models served as embedding models (core.pooling, Engine.encode): each prompt's
vector equals transformers' final hidden states pooled the same way (last token, mean, CLS)
and normalized as the checkpoint's sentence-transformers config says, alone, in mixed
batches, over chunked prefills and over a cached prefix; Matryoshka dimensions; and what
cannot be embedded refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny_model import HIDDEN, VOCAB, save_tiny_model, save_word_tokenizer

from radixmesh.api import Engine
from radixmesh.core.pooling import (
    Pooling,
    PoolingError,
    model_pooling,
    model_reranker,
    read_pooling,
)
from radixmesh.core.request import RequestError

FLAGS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
         "cls": "pooling_mode_cls_token"}
# Lengths around the chunk (8 tokens): within one chunk, exactly one, across three.
PROMPTS = [[(7 * i + 3 * k + 2) % (VOCAB - 1) for i in range(n)]
           for k, n in enumerate([5, 8, 20, 13])]


def save_sentence_transformer(path: Path, kind: str, pooling: str, normalize: bool = True,
                              seed: int = 0) -> Path:
    """A tiny random decoder with a sentence-transformers config: Transformer, Pooling
    (`pooling`) and, when `normalize`, Normalize."""
    save_tiny_model(path, kind, seed)
    save_word_tokenizer(path)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": HIDDEN, **{flag: k == pooling for k, flag in FLAGS.items()}}))
    return path


def reference(path: Path, prompts: list[list[int]], pooling: str, normalize: bool,
              dimensions: int | None = None) -> list[torch.Tensor]:
    """transformers' final hidden states (float32) of each prompt alone, pooled."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
            vector = vector[:dimensions] if dimensions else vector
            out.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return out


def assert_same(ours: list[float], theirs: torch.Tensor) -> None:
    got = torch.tensor(ours)
    assert got.shape == theirs.shape
    assert torch.nn.functional.cosine_similarity(got, theirs, dim=0) >= 0.99999
    assert (got - theirs).abs().max() <= 1e-4


def _engine(path: Path, **kwargs: object) -> Engine:
    return Engine(str(path), dtype="float32", max_total_tokens=2048, chunked_prefill_size=8,
                  show_progress=False, **kwargs)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_equal_transformers_pooled_the_same_way(tmp_path, kind, pooling):
    path = save_sentence_transformer(tmp_path / "st", kind, pooling)
    expected = reference(path, PROMPTS, pooling, normalize=True)
    with _engine(path) as engine:
        assert engine.pooling == Pooling(pooling, normalize=True)
        assert engine.model_info()["is_generation"] is False
        alone = [engine.encode(input_ids=ids) for ids in PROMPTS]
        engine.flush_cache()
        batch = engine.encode(input_ids=PROMPTS)
        # Each prompt again, after a longer one that shares its start was cached.
        longer = [[*PROMPTS[2], 1, 2, 3], PROMPTS[2]]
        cached = engine.encode(input_ids=longer)
    for one, together, theirs in zip(alone, batch, expected, strict=True):
        assert_same(one["embedding"], theirs)
        assert_same(together["embedding"], theirs)
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [len(p) for p in PROMPTS]
    assert_same(cached[1]["embedding"], expected[2])
    # Last-token pooling reuses the cached prefix (all but the last token); mean and CLS
    # pool every token's hidden state, which the cache does not keep, and compute it all.
    assert cached[1]["meta_info"]["cached_tokens"] == (19 if pooling == "last" else 0)


def test_matryoshka_dimensions_cut_then_normalize(tmp_path):
    path = save_sentence_transformer(tmp_path / "st", "qwen3", "last")
    expected = reference(path, PROMPTS[:2], "last", normalize=True, dimensions=16)
    with _engine(path) as engine:
        results = engine.encode(input_ids=PROMPTS[:2], dimensions=16)
        for bad in (0, HIDDEN + 1, "16", 2.5, True):
            with pytest.raises(RequestError, match="dimensions") as err:
                engine.encode(input_ids=PROMPTS[0], dimensions=bad)
            assert err.value.field == "dimensions"
        with pytest.raises(ValueError, match="embedding model"):
            engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 2})
        with pytest.raises(RequestError, match="input_ids"):
            engine.encode(input_ids=[])
        with pytest.raises(RequestError, match="input_ids"):
            engine.encode(input_ids=[VOCAB + 5])
        # Nothing refused above holds a slot.
        assert engine.encode(input_ids=PROMPTS[3])["meta_info"]["prompt_tokens"] == 13
        assert engine.server_info()["held_slots"] == 0
    for ours, theirs in zip(results, expected, strict=True):
        assert_same(ours["embedding"], theirs)


def test_a_base_model_checkpoint_embeds(tmp_path):
    """An embedding checkpoint saved as the base model alone (Qwen3-Embedding's layout: no
    "model." prefix, no lm_head) loads and embeds as transformers reads it."""
    from safetensors.torch import load_file, save_file

    path = save_sentence_transformer(tmp_path / "st", "qwen2", "last")
    weights = load_file(str(path / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"},
              str(path / "model.safetensors"))
    expected = reference(path, PROMPTS, "last", normalize=True)
    with _engine(path) as engine:
        ours = engine.encode(input_ids=PROMPTS)
    for one, theirs in zip(ours, expected, strict=True):
        assert_same(one["embedding"], theirs)


def test_a_model_without_normalize_gives_the_raw_pooled_state(tmp_path):
    path = save_sentence_transformer(tmp_path / "st", "llama", "mean", normalize=False)
    expected = reference(path, PROMPTS[2:], "mean", normalize=False)
    with _engine(path) as engine:
        assert engine.pooling == Pooling("mean", normalize=False)
        ours = engine.encode(input_ids=PROMPTS[2:])
    for one, theirs in zip(ours, expected, strict=True):
        assert_same(one["embedding"], theirs)


@pytest.fixture(scope="module")
def generation_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = save_tiny_model(tmp_path_factory.mktemp("plain") / "m")
    save_word_tokenizer(path)
    with _engine(path) as engine:
        yield engine


def test_a_generation_model_refuses_to_embed(generation_engine: Engine):
    assert generation_engine.pooling is None
    with pytest.raises(ValueError, match="is_embedding"):
        generation_engine.encode(input_ids=PROMPTS[0])
    with pytest.raises(RequestError, match="not a reranker"):
        generation_engine.rerank("t1 t2", ["t3"])


def test_pooling_is_read_from_the_checkpoint(tmp_path):
    plain = save_tiny_model(tmp_path / "plain")
    assert read_pooling(plain) is None
    assert model_pooling(plain, is_embedding=False) is None
    assert model_pooling(plain, is_embedding=True) == Pooling("last", normalize=True)
    st = save_sentence_transformer(tmp_path / "st", "llama", "cls", normalize=False)
    assert model_pooling(st, is_embedding=False) == Pooling("cls", normalize=False)
    config = st / "1_Pooling" / "config.json"
    config.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(PoolingError, match="pooling_mode_max_tokens"):
        read_pooling(st)
    config.write_text(json.dumps({}))  # no mode set: the last token
    assert read_pooling(st) == Pooling("last", normalize=False)
    metadata = {"general.architecture": "qwen3", "qwen3.pooling_type": 1}
    assert read_pooling(tmp_path, metadata) == Pooling("mean")
    assert read_pooling(tmp_path, {**metadata, "qwen3.pooling_type": 0}) is None
    with pytest.raises(PoolingError, match="pooling_type 4"):
        read_pooling(tmp_path, {**metadata, "qwen3.pooling_type": 4})


def test_finish_cuts_then_normalizes():
    assert Pooling("last").finish([3.0, 4.0, 12.0], 2) == [0.6, 0.8]
    assert Pooling("last", normalize=False).finish([3.0, 4.0, 12.0]) == [3.0, 4.0, 12.0]
    assert Pooling("last").finish([0.0, 0.0]) == [0.0, 0.0]


RERANK_TEMPLATE = "t1 t2 {query} t3 {document} t4"
QUERY, DOCUMENTS = "t10 t11 t12 t13", ["t20 t21", "t30 t31 t32 t33 t34", "t40", "t50 t51 t52"]


def reference_scores(path: Path, yes: int, no: int) -> list[float]:
    """transformers' P(yes) against P(no) at each filled-in prompt's last position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for doc in DOCUMENTS:
            text = RERANK_TEMPLATE.replace("{query}", QUERY).replace("{document}", doc)
            ids = [int(word[1:]) for word in text.split()]
            logits = model(torch.tensor([ids])).logits[0, -1]
            scores.append(torch.softmax(logits[[yes, no]], dim=0)[0].item())
    return scores


@pytest.mark.parametrize("named_by", ["config", "flag"])
def test_a_decoder_reranker_scores_as_transformers_does(tmp_path, named_by):
    path = save_tiny_model(tmp_path / "reranker", "qwen3", seed=3)
    save_word_tokenizer(path)
    kwargs: dict[str, object] = {"rerank_template": RERANK_TEMPLATE}
    if named_by == "config":  # vLLM's order: the "no" token, then the "yes" token
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config,
                                                      "classifier_from_token": ["t9", "t7"]}))
    else:
        kwargs["rerank_tokens"] = "t7,t9"
    expected = reference_scores(path, yes=7, no=9)
    with _engine(path, **kwargs) as engine:
        assert engine.reranker is not None and engine.reranker.score_ids == (7, 9)
        results = engine.rerank(QUERY, DOCUMENTS)
        top = engine.rerank(QUERY, [{"text": d} for d in DOCUMENTS], top_n=2,  # type: ignore[misc]
                            return_documents=False)
        with pytest.raises(ValueError, match="embedding model"):
            engine.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
        for query, documents, top_n, field in [("", DOCUMENTS, None, "query"),
                                               (QUERY, [], None, "documents"),
                                               (QUERY, [3], None, "documents"),
                                               (QUERY, DOCUMENTS, 0, "top_n")]:
            with pytest.raises(RequestError) as err:
                engine.rerank(query, documents, top_n)
            assert err.value.field == field
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    assert [r["index"] for r in results] == order
    for result in results:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    assert [r["index"] for r in top] == order[:2] and all("document" not in r for r in top)


def test_rerank_tokens_must_be_single_tokens(tmp_path):
    path = save_tiny_model(tmp_path / "m")
    save_word_tokenizer(path)
    with pytest.raises(PoolingError, match="two tokens"):
        model_reranker(path, lambda t: [1], "yes")
    with pytest.raises(PoolingError, match="2 tokens"):
        model_reranker(path, lambda t: t.split(), "t1 t2,t3")
    assert model_reranker(path, lambda t: [int(t[1:])], None) is None
