"""Embedding and reranking models: how a checkpoint pools a prompt's final hidden states
into one vector, how that vector is finished for a client, and how a decoder reranker scores
a document by its answer tokens.

A decoder served as an embedding model computes its prompt once (prefill only) and pools
the final (normed) hidden states: the last token's, their mean, or the first token's (CLS),
as the checkpoint's sentence-transformers config says (`modules.json`, `1_Pooling/
config.json`) or, in a GGUF file, its `pooling_type`; else the last token's. The vector is
L2-normalized when the config lists a Normalize module (always, without a config), after
being cut to the `dimensions` a client asks for (Matryoshka embeddings).

A decoder reranker (Qwen3-Reranker) reads a query and a document in its own prompt template
and answers with one of two tokens: the relevance score is the probability of the "yes"
token against the "no" token at the prompt's last position, from their two logits (pooling
"score": the engine returns those logits instead of a vector)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixmesh.core.gguf import read_gguf
from radixmesh.core.model_files import is_gguf
from radixmesh.core.request import RequestError, is_int

if TYPE_CHECKING:
    from radixmesh.core.settings import ModelSettings
    from radixmesh.core.tokenizer import Tokenizer

# A request's pooling (NewRequest.pooling) is "last", "mean" or "cls" (a Pooling's kind),
# or "score": the last position's logits of the request's score_ids; "" for generation.
# Qwen3-Reranker's prompt, with the instruction its model card uses by default.
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    "Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\"."
    "<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant "
    "passages that answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
_PLACES = re.compile(r"\{(query|document)\}")
# sentence-transformers' Pooling flags, and GGUF's pooling_type values, for each kind.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}
_GGUF_TYPES = {1: "mean", 2: "cls", 3: "last"}


class PoolingError(ValueError):
    """A checkpoint's pooling that cannot be served."""


@dataclass(frozen=True)
class Pooling:
    """How the served model turns a prompt into its embedding."""

    kind: str = "last"
    normalize: bool = True

    def check_dimensions(self, dimensions: object, hidden_size: int) -> int | None:
        """A client's `dimensions` (None: the model's own), or RequestError naming it."""
        if dimensions is None:
            return None
        if not is_int(dimensions) or not 1 <= dimensions <= hidden_size:
            raise RequestError(f"dimensions must be an integer from 1 to {hidden_size} (the "
                               f"model's), got {dimensions!r}", "dimensions")
        return dimensions

    def finish(self, vector: list[float], dimensions: int | None = None) -> list[float]:
        """The client's embedding from the pooled hidden state: its first `dimensions`
        values (all without), L2-normalized when the model normalizes."""
        out = vector[:dimensions] if dimensions else list(vector)
        if self.normalize:
            norm = math.sqrt(math.fsum(v * v for v in out))
            if norm > 0:
                out = [v / norm for v in out]
        return out


def read_pooling(model_path: Path, gguf_metadata: Mapping[str, Any] | None = None
                 ) -> Pooling | None:
    """The pooling the checkpoint at `model_path` declares (None: it declares none, so it is
    not an embedding model by itself). PoolingError for a kind not served (max, weighted)."""
    if gguf_metadata is not None:
        arch = gguf_metadata.get("general.architecture", "")
        value = gguf_metadata.get(f"{arch}.pooling_type")
        if value in (None, 0):
            return None
        if value not in _GGUF_TYPES:
            raise PoolingError(f"GGUF pooling_type {value} is not served (mean, cls or last)")
        return Pooling(_GGUF_TYPES[value])
    modules_file = model_path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    if "Pooling" not in types:
        return None
    config_file = model_path / types["Pooling"].get("path", "1_Pooling") / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    chosen = [kind for flag, kind in _ST_MODES.items() if config.get(flag)]
    others = sorted(f for f, on in config.items()
                    if f.startswith("pooling_mode_") and on and f not in _ST_MODES)
    if others or len(chosen) > 1:
        raise PoolingError(f"sentence-transformers pooling {others or chosen} is not served: "
                           "one of last token, mean or CLS")
    return Pooling(chosen[0] if chosen else "last", normalize="Normalize" in types)


def model_pooling(model_path: Path, is_embedding: bool) -> Pooling | None:
    """How the model at `model_path` is served: pooled as its checkpoint declares, or by
    the last token where `is_embedding` asks for embeddings of a model that declares
    nothing; None: it generates."""
    metadata = read_gguf(model_path, tensors=False).metadata if is_gguf(model_path) else None
    declared = read_pooling(model_path, metadata)
    if declared is None and is_embedding:
        return Pooling()
    return declared


@dataclass(frozen=True)
class Reranker:
    """A decoder reranker: its prompt template ({query} and {document}) and the token ids of
    its relevant and irrelevant answers."""

    yes_id: int
    no_id: int
    template: str = RERANK_TEMPLATE

    @property
    def score_ids(self) -> tuple[int, int]:
        """The logits a scoring request asks for, in the order score() reads them."""
        return self.yes_id, self.no_id

    def prompt(self, query: str, document: str) -> str:
        """The template filled in (one pass: braces in the texts stay as they are)."""
        parts = {"query": query, "document": document}
        return _PLACES.sub(lambda m: parts[m.group(1)], self.template)

    @staticmethod
    def score(logits: list[float]) -> float:
        """P(yes) against P(no), from their logits (yes first)."""
        yes, no = logits
        return 1.0 / (1.0 + math.exp(min(no - yes, 700.0)))


def ranked(scores: list[float], documents: list[str], top_n: int | None,
           return_documents: bool) -> list[dict[str, Any]]:
    """The rerank results: best first (ties in input order), `top_n` of them (all without),
    each with its input index, score and, when asked, its document."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: top_n or len(scores)]
    out: list[dict[str, Any]] = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            result["document"] = {"text": documents[i]}
        out.append(result)
    return out


def model_reranker(model_path: Path, encode: Callable[[str], list[int]],
                   rerank_tokens: str | None, template: str | None = None) -> Reranker | None:
    """The model as a reranker: answer tokens from `rerank_tokens` ("YES,NO") or the
    checkpoint's config.json classifier_from_token (["no", "yes"], as vLLM reads it); None
    where neither names them. PoolingError for a token that is not one token."""
    if rerank_tokens:
        names = [t.strip() for t in rerank_tokens.split(",")]
        if len(names) != 2 or not all(names):
            raise PoolingError(f"rerank_tokens must name two tokens, YES,NO; got "
                               f"{rerank_tokens!r}")
    else:
        config = model_path / "config.json"
        tokens = json.loads(config.read_text()).get("classifier_from_token") if (
            config.is_file()) else None
        if not tokens:
            return None
        if len(tokens) != 2:
            raise PoolingError(f"classifier_from_token must name two tokens, got {tokens!r}")
        names = [tokens[1], tokens[0]]
    ids = []
    for name in names:
        encoded = encode(name)
        if len(encoded) != 1:
            raise PoolingError(f"the rerank token {name!r} is {len(encoded)} tokens, not one")
        ids.append(encoded[0])
    return Reranker(ids[0], ids[1], template or RERANK_TEMPLATE)


def rerank_inputs(query: object, documents: object, top_n: object) -> list[str]:
    """The documents' texts (each a string or {"text": ...}), after checking the query,
    documents and top_n a rerank request brings; RequestError naming the field."""
    if not isinstance(query, str) or not query:
        raise RequestError("query must be a non-empty string", "query")
    if not isinstance(documents, list) or not documents:
        raise RequestError("documents must be a non-empty list", "documents")
    texts = []
    for doc in documents:
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise RequestError("each document must be a string or an object with a string "
                               f"text, got {doc!r}", "documents")
        texts.append(text)
    if top_n is not None and (not is_int(top_n) or top_n < 1):
        raise RequestError(f"top_n must be a positive integer, got {top_n!r}", "top_n")
    return texts


def model_serving(model_path: Path, tokenizer: Tokenizer, settings: ModelSettings
                  ) -> tuple[Pooling | None, Reranker | None]:
    """How the model at `model_path` is served, as `settings` and its checkpoint say: its
    pooling (None: it generates) and, for a reranker (which embeds too), its answer tokens
    and prompt."""
    reranker = model_reranker(
        model_path, lambda text: tokenizer.encode(text, add_special_tokens=False),
        settings.rerank_tokens, settings.rerank_template)
    return model_pooling(model_path, settings.is_embedding or reranker is not None), reranker
