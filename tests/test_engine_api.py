"""End-to-end tests of the offline Engine on the bundled SmolLM2-135M-Instruct.

One float32 engine serves most tests (so the prefix cache carries over between them;
tests that count cached tokens flush it first); a second one with tiny prefill chunks
checks that chunking changes nothing a caller can see. Logprobs: test_engine_logprobs.py."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from engine_helpers import (
    GREEDY,
    Result,
    assert_nothing_held,
    in_thread,
    one,
)

from radixmesh.api import Engine
from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.engine.request import Req
from radixmesh.request_output import RequestStream

PROMPT = "The capital of France is"
# Greedy SmolLM2 answers this in a few tokens and then emits <|im_end|> (eos id 2).
EOS_CHAT = (
    "<|im_start|>user\nWhat is 2+2? Answer with one number.<|im_end|>\n<|im_start|>assistant\n"
)
# ... while it keeps talking here.
LONG_CHAT = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
EOS_ID = 2


@pytest.fixture(scope="module")
def greedy16(engine: Engine) -> Result:
    """PROMPT's greedy continuation, 16 tokens; any shorter greedy run is a prefix of it."""
    out = engine.generate(PROMPT, {"max_new_tokens": 16, **GREEDY})
    assert isinstance(out, dict)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    return out


def tokens_until(engine: Engine, ids: list[int], text: str) -> int:
    """Fewest leading ids whose decoded text contains `text`."""
    for n in range(1, len(ids) + 1):
        if text in engine.tokenizer.decode(ids[:n]):
            return n
    raise AssertionError(f"{text!r} never appears")


# ---- 1, 2: basic generation ---------------------------------------------------------------


def test_generate_returns_text_ids_and_meta(engine: Engine, greedy16: Result) -> None:
    out = one(engine, PROMPT, {"max_new_tokens": 8, "temperature": 0})
    assert set(out) == {"text", "output_ids", "meta_info"}
    ids = out["output_ids"]
    assert len(ids) == 8 and all(isinstance(t, int) for t in ids)
    assert ids == greedy16["output_ids"][:8]
    assert out["text"] == engine.tokenizer.decode(ids)
    assert out["text"] and greedy16["text"].startswith(out["text"])
    meta = out["meta_info"]
    assert isinstance(meta["id"], str) and meta["id"]
    assert meta["id"] != greedy16["meta_info"]["id"]
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode(PROMPT))
    assert meta["completion_tokens"] == 8
    assert meta["cached_tokens"] == meta["prompt_tokens"] - 1  # greedy16 ran it just before
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert "output_token_logprobs" not in meta
    assert meta["cached_tokens_details"] == {
        "device": meta["cached_tokens"], "host": 0, "storage": 0
    }
    assert list(meta) == ["id", "finish_reason", "prompt_tokens", "completion_tokens",
                          "cached_tokens", "cached_tokens_details"]


def test_rid_and_input_ids_are_honoured(engine: Engine, greedy16: Result) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, **GREEDY}, rid="x1")
    assert isinstance(out, dict)
    assert out["meta_info"]["id"] == "x1"
    assert out["output_ids"] == greedy16["output_ids"][:4]


def test_batch_keeps_order_and_matches_single_runs(engine: Engine, greedy16: Result) -> None:
    prompts = [PROMPT, "Hello, my name is", "The quick brown fox jumps over the lazy dog. Then"]
    params = {"max_new_tokens": 8, **GREEDY}
    batch = engine.generate(prompts, params)
    assert isinstance(batch, list) and len(batch) == 3
    alone = [greedy16["output_ids"][:8]] + [
        one(engine, p, params)["output_ids"] for p in prompts[1:]
    ]
    for prompt, got, want in zip(prompts, batch, alone, strict=True):
        assert got["output_ids"] == want
        assert got["text"] == engine.tokenizer.decode(want)
        assert got["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode(prompt))
        assert got["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert len({r["meta_info"]["id"] for r in batch}) == 3
    # input_ids lists batch the same way
    by_ids = engine.generate(
        input_ids=[engine.tokenizer.encode(p) for p in prompts[:2]], sampling_params=params
    )
    assert isinstance(by_ids, list)
    assert [r["output_ids"] for r in by_ids] == alone[:2]


def test_max_new_tokens_zero_only_prefills(engine: Engine) -> None:
    out = one(engine, PROMPT, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert out["output_ids"] == [] and meta["completion_tokens"] == 0 and out["text"] == ""


# ---- 3: prefix cache ----------------------------------------------------------------------


def test_repeated_prompt_hits_the_prefix_cache(engine: Engine) -> None:
    assert engine.flush_cache() is True
    prompt = "Write one sentence about the sea."
    params = {"max_new_tokens": 4, **GREEDY}
    first = one(engine, prompt, params)
    second = one(engine, prompt, params)
    n = first["meta_info"]["prompt_tokens"]
    assert first["meta_info"]["cached_tokens"] == 0
    assert first["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0}
    # all but the last prompt token, whose logits the new request must compute
    assert second["meta_info"]["cached_tokens"] == n - 1
    assert second["meta_info"]["cached_tokens_details"] == {
        "device": n - 1, "host": 0, "storage": 0
    }
    assert second["output_ids"] == first["output_ids"]  # the cached K/V is the right K/V
    salted = one(engine, prompt, params, cache_salt="tenant-b")
    assert salted["meta_info"]["cached_tokens"] == 0
    assert salted["output_ids"] == first["output_ids"]
    assert_nothing_held(engine)


def test_meta_info_splits_the_cached_tokens_by_tier(engine: Engine) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    req = Req(rid="tiers", input_ids=prompt, params=SamplingParams(max_new_tokens=1), seed=0)
    req.cached_tokens, req.cached_host_tokens = len(prompt) - 1, 2  # as HiCache reports it
    req.output_ids.append(prompt[0])
    req.finish = FinishReason(FinishKind.LENGTH, 1)
    stream = RequestStream(req, engine.tokenizer, streaming=True)
    stream.update()
    meta = stream.result()["meta_info"]
    assert meta["cached_tokens"] == len(prompt) - 1
    assert meta["cached_tokens_details"] == {"device": len(prompt) - 3, "host": 2, "storage": 0}
    assert [chunk["meta_info"] for chunk in stream.chunks()] == [meta]


def test_multi_turn_reuses_the_previous_turn(engine: Engine) -> None:
    tok = engine.tokenizer
    turn1 = tok.encode(LONG_CHAT)
    out1 = engine.generate(input_ids=turn1, sampling_params={"max_new_tokens": 8, **GREEDY})
    assert isinstance(out1, dict) and len(out1["output_ids"]) == 8
    follow = tok.encode("<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    turn2 = turn1 + out1["output_ids"] + follow
    out2 = engine.generate(input_ids=turn2, sampling_params={"max_new_tokens": 4, **GREEDY})
    assert isinstance(out2, dict)
    meta = out2["meta_info"]
    assert meta["prompt_tokens"] == len(turn2)
    assert meta["cached_tokens"] >= len(turn1) + len(out1["output_ids"]) - 1
    assert meta["cached_tokens"] < len(turn2)


# ---- 4: seeds -----------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_batch_invariant(engine: Engine) -> None:
    prompt = "Once upon a time"

    def params(seed: int) -> dict[str, Any]:
        return {"max_new_tokens": 8, "temperature": 0.8, "seed": seed}

    alone = one(engine, prompt, params(42))
    again = one(engine, prompt, params(42))
    assert again["output_ids"] == alone["output_ids"]
    assert again["text"] == alone["text"]
    prompts = [prompt, prompt, prompt, prompt, "My favourite food is", "In 1999, the"]
    seeds = [42, 1, 2, 3, 7, 8]
    batch = engine.generate(prompts, [params(s) for s in seeds])
    assert isinstance(batch, list)
    assert batch[0]["output_ids"] == alone["output_ids"]
    assert any(r["output_ids"] != alone["output_ids"] for r in batch[1:4])
    assert all(len(r["output_ids"]) == 8 for r in batch)


# ---- 5: stopping --------------------------------------------------------------------------


def test_stop_strings_and_stop_token_ids(engine: Engine, greedy16: Result) -> None:
    tok = engine.tokenizer
    ids, text = greedy16["output_ids"], greedy16["text"]
    # a stop string spanning several tokens, starting after the first one
    stop = tok.decode(ids[1:5])
    assert stop.strip() and text.index(stop) > 0
    upto = tokens_until(engine, ids, stop)
    # a stop token that first occurs at position i >= 2
    i = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    base = {"max_new_tokens": 16, **GREEDY}
    runs = engine.generate(
        [PROMPT] * 4,
        [
            {**base, "stop": stop},
            {**base, "stop": [stop, "never-in-the-output"], "no_stop_trim": True},
            {**base, "stop_token_ids": [ids[i]]},
            {**base, "stop_token_ids": [ids[i]], "no_stop_trim": True},
        ],
    )
    assert isinstance(runs, list)
    trimmed, kept, by_token, by_token_kept = runs
    assert trimmed["text"] == text[: text.index(stop)]
    assert trimmed["output_ids"] == ids[:upto]
    assert trimmed["meta_info"]["completion_tokens"] == upto
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert kept["text"] == text[: text.index(stop) + len(stop)]
    assert kept["output_ids"] == ids[:upto]
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    for run in (by_token, by_token_kept):
        assert run["output_ids"] == ids[: i + 1]
        assert run["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[i]}
    # like SGLang, the matched stop token's text is trimmed unless no_stop_trim
    assert by_token["text"] == tok.decode(ids[:i])
    assert by_token_kept["text"] == tok.decode(ids[: i + 1])


def test_stop_strings_wait_for_min_new_tokens(engine: Engine, greedy16: Result) -> None:
    ids, text = greedy16["output_ids"], greedy16["text"]
    stop = engine.tokenizer.decode(ids[1:3])
    upto = tokens_until(engine, ids, stop)
    assert upto < 10
    out = one(engine, PROMPT, {"max_new_tokens": 16, "min_new_tokens": 10, "stop": stop, **GREEDY})
    # The early occurrence does not count; generation runs past min_new_tokens.
    assert len(out["output_ids"]) >= 10
    assert out["output_ids"] == ids[: len(out["output_ids"])]
    assert out["text"].startswith(text[: text.index(stop) + len(stop)])


def test_eos_ignore_eos_and_min_new_tokens(engine: Engine) -> None:
    runs = engine.generate(
        [EOS_CHAT] * 6,
        [
            {"max_new_tokens": 16, **GREEDY},
            {"max_new_tokens": 12, "ignore_eos": True, **GREEDY},
            {"max_new_tokens": 24, "min_new_tokens": 20, **GREEDY},
            {"max_new_tokens": 16, "skip_special_tokens": False, **GREEDY},
            {"max_new_tokens": 16, "skip_special_tokens": False, "no_stop_trim": True, **GREEDY},
            {"max_new_tokens": 16, "skip_special_tokens": False, "no_stop_trim": True,
             "spaces_between_special_tokens": False, **GREEDY},
        ],
    )
    assert isinstance(runs, list)
    plain, ignored, at_least, special, special_kept, unspaced = runs
    ids = plain["output_ids"]
    assert len(ids) < 16 and ids[-1] == EOS_ID and EOS_ID not in ids[:-1]
    assert plain["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    assert plain["text"] == engine.tokenizer.decode(ids[:-1])
    assert "<|im_end|>" not in plain["text"]

    assert len(ignored["output_ids"]) == 12
    assert ignored["output_ids"][: len(ids)] == ids  # ran straight through the eos
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 12}

    got = at_least["output_ids"]
    assert 20 <= len(got) <= 24
    assert EOS_ID not in got[:20]
    finish = at_least["meta_info"]["finish_reason"]
    assert finish in ({"type": "length", "length": 24}, {"type": "stop", "matched": EOS_ID})
    assert (finish["type"] == "stop") == (got[-1] == EOS_ID)

    # eos is a stop token: trimmed from the text unless no_stop_trim
    assert special["output_ids"] == ids and special["text"] == plain["text"]
    # Shown, a special token is set apart by a space unless spaces_between_special_tokens is off.
    assert special_kept["text"] == plain["text"] + " <|im_end|>"
    assert unspaced["text"] == plain["text"] + "<|im_end|>"


# ---- 7: streaming -------------------------------------------------------------------------


def collect(chunks: Any) -> list[Result]:
    got = list(chunks)
    assert got, "no chunks"
    for chunk in got[:-1]:
        assert chunk["meta_info"]["finish_reason"] is None
    return got


def test_streaming_matches_the_whole_result(engine: Engine, greedy16: Result) -> None:
    chunks = collect(engine.generate(PROMPT, {"max_new_tokens": 16, **GREEDY}, stream=True))
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == greedy16["text"]
    assert [t for c in chunks for t in c["output_ids"]] == greedy16["output_ids"]
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": 16}
    assert last["completion_tokens"] == 16
    # completion_tokens grows with the ids streamed so far
    seen = 0
    for c in chunks:
        seen += len(c["output_ids"])
        assert c["meta_info"]["completion_tokens"] == seen


def test_streaming_with_a_stop_string(engine: Engine, greedy16: Result) -> None:
    text = greedy16["text"]
    stop = engine.tokenizer.decode(greedy16["output_ids"][1:5])
    params = {"max_new_tokens": 16, "stop": stop, **GREEDY}
    whole = one(engine, PROMPT, params)
    chunks = collect(engine.generate(PROMPT, params, stream=True))
    assert "".join(c["text"] for c in chunks) == whole["text"] == text[: text.index(stop)]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_batched_streaming_is_refused_before_anything_runs(engine: Engine) -> None:
    with pytest.raises(ValueError, match="stream"):
        engine.generate([PROMPT, PROMPT], {"max_new_tokens": 8}, stream=True)
    assert_nothing_held(engine)  # neither prompt was queued


# ---- 8: abort -----------------------------------------------------------------------------


def test_abort_running_requests(engine: Engine, greedy16: Result) -> None:
    long = {"max_new_tokens": 200, "ignore_eos": True, **GREEDY}
    blocking = in_thread(engine.generate, LONG_CHAT, long, rid="abort-blocking")
    chunks = engine.generate(PROMPT, long, rid="abort-streamed", stream=True)
    assert isinstance(chunks, Iterator)
    first = next(chunks)
    assert first["output_ids"] and first["meta_info"]["finish_reason"] is None
    # while they run: the cache cannot be flushed and their ids are taken
    assert engine.flush_cache() is False
    with pytest.raises(ValueError, match="duplicate"):
        engine.generate("Hi", {"max_new_tokens": 2}, rid="abort-streamed")
    engine.abort("abort-streamed")
    engine.abort("abort-blocking")
    engine.abort("no-such-request")  # ignored
    rest = collect(chunks)
    done = blocking.result(timeout=120)
    streamed = [t for c in [first, *rest] for t in c["output_ids"]]
    final = rest[-1]["meta_info"]
    assert final["id"] == "abort-streamed"
    assert final["finish_reason"]["type"] == "abort"
    assert 1 <= len(streamed) == final["completion_tokens"] < 200
    assert streamed[:16] == greedy16["output_ids"][: len(streamed)]
    assert done["meta_info"]["id"] == "abort-blocking"
    assert done["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(done["output_ids"]) < 200
    assert_nothing_held(engine)
    after = one(engine, PROMPT, {"max_new_tokens": 4, **GREEDY}, rid="abort-streamed")
    assert after["output_ids"] == greedy16["output_ids"][:4]
    assert after["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


# ---- 9: bad input -------------------------------------------------------------------------


BAD_INPUTS: list[tuple[str, Callable[[Engine], dict[str, Any]], str]] = [
    ("empty-prompt", lambda e: {"prompt": ""}, "prompt"),
    ("no-prompts", lambda e: {"prompt": []}, "prompt"),
    ("empty-input-ids", lambda e: {"input_ids": []}, "input_ids"),
    ("neither", lambda e: {}, "prompt and input_ids"),
    ("both", lambda e: {"prompt": "Hi", "input_ids": [1, 2]}, "prompt and input_ids"),
    ("out-of-vocab", lambda e: {"input_ids": [1, e.model_config.vocab_size]}, "input_ids"),
    ("negative-id", lambda e: {"input_ids": [1, -3]}, "input_ids"),
    (
        "longer-than-context",
        lambda e: {"input_ids": [100] * (e.context_length + 1)},
        "context length",
    ),
    ("exactly-context", lambda e: {"input_ids": [100] * e.context_length}, "context length"),
    ("max_new_tokens", lambda e: {"sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("max_new_tokens-type", lambda e: {"sampling_params": {"max_new_tokens": 2.5}}, "max_new"),
    (
        "min_new_tokens",
        lambda e: {"sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}},
        "min_new_tokens",
    ),
    ("temperature", lambda e: {"sampling_params": {"temperature": -0.5}}, "temperature"),
    ("top_p-zero", lambda e: {"sampling_params": {"top_p": 0}}, "top_p"),
    ("top_p-big", lambda e: {"sampling_params": {"top_p": 1.5}}, "top_p"),
    ("stop-int", lambda e: {"sampling_params": {"stop": 5}}, "stop"),
    ("stop-empty", lambda e: {"sampling_params": {"stop": ""}}, "stop"),
    (
        "stop_token_ids",
        lambda e: {"sampling_params": {"stop_token_ids": [e.model_config.vocab_size]}},
        "stop_token_ids",
    ),
    ("unknown-key", lambda e: {"sampling_params": {"temprature": 0.5}}, "temprature"),
    ("params-not-dict", lambda e: {"sampling_params": "greedy"}, "sampling_params"),
    ("top_logprobs_num", lambda e: {"top_logprobs_num": -1}, "top_logprobs_num"),
    ("logprob_start_len", lambda e: {"logprob_start_len": -2}, "logprob_start_len"),
    (
        "params-count",
        lambda e: {"prompt": ["a", "b"], "sampling_params": [{}, {}, {}]},
        "sampling_params",
    ),
]


@pytest.mark.parametrize(
    ("kwargs", "field"), [pytest.param(k, f, id=name) for name, k, f in BAD_INPUTS]
)
def test_bad_input_raises_value_error(
    engine: Engine, kwargs: Callable[[Engine], dict[str, Any]], field: str
) -> None:
    args = kwargs(engine)
    if "prompt" not in args and "input_ids" not in args and args:
        args["prompt"] = "Hi"
    with pytest.raises(ValueError, match=field):
        engine.generate(**args)


def test_prompt_larger_than_the_kv_pool_is_refused(chunked: Engine) -> None:
    # within the context length (8192) but not the 2048-slot pool: the scheduler refuses it
    with pytest.raises(ValueError, match="KV pool"):
        chunked.generate(input_ids=[100] * 3000, sampling_params={"max_new_tokens": 1})
    assert_nothing_held(chunked)


def test_engine_serves_after_bad_input(engine: Engine, greedy16: Result) -> None:
    assert_nothing_held(engine)
    out = one(engine, PROMPT, {"max_new_tokens": 4, **GREEDY})
    assert out["output_ids"] == greedy16["output_ids"][:4]
    assert_nothing_held(engine)


# ---- 10: flush_cache ----------------------------------------------------------------------


def test_flush_cache_drops_every_prefix(engine: Engine) -> None:
    params = {"max_new_tokens": 1, **GREEDY}
    one(engine, PROMPT, params)
    warm = one(engine, PROMPT, params)
    assert warm["meta_info"]["cached_tokens"] == warm["meta_info"]["prompt_tokens"] - 1
    assert engine.flush_cache() is True
    info = assert_nothing_held(engine)
    assert info["cached_tokens"] == 0 and info["free_slots"] == info["num_slots"]
    cold = one(engine, PROMPT, params)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert cold["output_ids"] == warm["output_ids"]


# ---- shutdown and failures ----------------------------------------------------------------


def test_a_failed_step_fails_requests_instead_of_hanging(chunked: Engine, caplog) -> None:
    def broken(batch: Any) -> Any:
        raise RuntimeError("device lost")

    chunked.runner.launch = broken  # type: ignore[method-assign]  # how the engine runs steps
    pending = in_thread(chunked.generate, PROMPT, {"max_new_tokens": 2})
    with pytest.raises(RuntimeError, match="device lost"):
        pending.result(timeout=60)
    with pytest.raises(RuntimeError, match="not running"):
        chunked.generate(PROMPT, {"max_new_tokens": 2})
    with pytest.raises(RuntimeError):
        chunked.server_info()
    chunked.shutdown()
    chunked.shutdown()  # idempotent
    gc.collect()  # the other step in flight failed too, and its failure was retrieved
    assert "never retrieved" not in caplog.text


def test_shutdown_fails_unfinished_requests() -> None:
    eng = Engine(dtype="float32", max_total_tokens=1024, show_progress=False)
    started = threading.Event()

    def stream_forever() -> list[Result]:
        chunks = eng.generate(PROMPT, {"max_new_tokens": 500, "ignore_eos": True}, stream=True)
        assert isinstance(chunks, Iterator)
        got = [next(chunks)]
        started.set()
        got.extend(chunks)
        return got

    running = in_thread(stream_forever)
    assert started.wait(timeout=120)
    eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        running.result(timeout=60)
    with pytest.raises(RuntimeError, match="not running"):
        eng.generate(PROMPT, {"max_new_tokens": 2})


# ---- logit_bias -----------------------------------------------------------------------------


def test_logit_bias_forces_and_bans_tokens(engine: Engine, greedy16: Result) -> None:
    banana = engine.tokenizer.encode(" banana")[0]
    for seed in (1, 2, 3):
        forced = one(engine, PROMPT, {"max_new_tokens": 6, "seed": seed,
                                      "logit_bias": {str(banana): 100}})
        assert forced["output_ids"] == [banana] * 6
    first = greedy16["output_ids"][0]
    banned = one(engine, PROMPT, {"max_new_tokens": 16, "logit_bias": {first: -100}, **GREEDY})
    assert first not in banned["output_ids"]
    assert banned["output_ids"] != greedy16["output_ids"]


def test_logit_bias_stays_inside_the_grammar(engine: Engine) -> None:
    tok = engine.tokenizer
    no, banana = tok.encode("no")[0], tok.encode(" banana")[0]
    out = one(engine, "Is the sky green? Answer yes or no:",
              {"max_new_tokens": 8, "regex": "(yes|no)", "logit_bias": {no: 100, banana: 100},
               **GREEDY})
    assert out["text"] == "no"
    assert banana not in out["output_ids"]
