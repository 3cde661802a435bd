"""The benchmark's statistics and stream readers, without sockets."""

from __future__ import annotations

import pytest

from radixmesh.bench.report import format_run, format_sweep
from radixmesh.bench.stats import RequestResult, cache_hit_rate, percentile, summarize
from radixmesh.bench.streams import (
    NativeStream,
    OpenAIStream,
    StreamError,
    TokenClock,
    sse_payload,
)


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def _result(turn=1, **kw) -> RequestResult:
    base = {"conversation": 0, "turn": turn, "sent_tokens": 100, "requested_tokens": 4,
            "output_tokens": 4, "ttft": 0.1, "latency": 0.4, "itls": [0.1, 0.1, 0.1]}
    return RequestResult(**(base | kw))


def test_summarize_throughput_latency_and_hit_rate():
    results = [
        _result(prompt_tokens=100, cached_tokens=0),
        _result(prompt_tokens=100, cached_tokens=80, ttft=0.3, latency=0.9, itls=[0.2] * 3),
        _result(error="HTTP 500: boom", output_tokens=0),
    ]
    s = summarize(results, duration=2.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 500: boom"]
    assert s["input_tokens"] == 200 and s["output_tokens"] == 8
    assert s["expected_output_tokens"] == 8 and s["exact_output_lengths"]
    assert s["request_throughput"] == 1.0
    assert s["output_throughput"] == 4.0 and s["total_throughput"] == 104.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["itl_ms"]["p50"] == pytest.approx(150.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)  # (0.4-0.1)/3 and (0.9-0.3)/3
    assert s["e2e_latency_ms"]["p99"] == pytest.approx(895.0)
    assert s["cache_hit_rate"] == pytest.approx(0.4)
    assert "ttft_by_turn_ms" not in s


def test_summarize_per_turn_and_inexact_lengths():
    results = [_result(turn=1, ttft=1.0, cached_tokens=0),
               _result(turn=2, ttft=0.2, cached_tokens=90, output_tokens=3)]
    s = summarize(results, duration=1.0)
    assert s["ttft_by_turn_ms"]["1"]["mean"] == pytest.approx(1000.0)
    assert s["ttft_by_turn_ms"]["2"]["mean"] == pytest.approx(200.0)
    assert s["cache_hit_rate_by_turn"] == {"1": 0.0, "2": 0.9}
    assert not s["exact_output_lengths"]
    text = format_run({"workload": "multi-turn", "max_concurrency": 2, "request_rate": None,
                       **s})
    assert "turn 2: TTFT" in text and "NOT exact" in text
    assert "hit rate" in format_sweep([{"max_concurrency": 2, **s}])


def test_hit_rate_absent_when_the_server_does_not_report():
    assert cache_hit_rate([_result(), _result()]) is None
    s = summarize([_result(error="x")], duration=1.0)
    assert s["completed"] == 0 and s["ttft_ms"] is None and s["cache_hit_rate"] is None


def test_sse_payload_lines():
    assert sse_payload("") is None
    assert sse_payload(": keep-alive") is None
    assert sse_payload("data: [DONE]") is None
    assert sse_payload('data: {"a": 1}\n') == {"a": 1}
    with pytest.raises(StreamError, match="too long"):
        sse_payload('data: {"error": {"message": "too long", "code": 400}}')


def test_token_clock_spreads_a_chunk_over_its_tokens():
    clock = TokenClock(started=10.0)
    clock.observe(10.5, 2)  # first chunk: two tokens at once
    clock.observe(10.5, 2)  # a repeat with nothing new
    clock.observe(10.8, 5)
    assert clock.ttft == 0.5
    assert clock.itls == pytest.approx([0.1, 0.1, 0.1])
    assert clock.tokens == 5


def test_native_stream_reads_cumulative_events():
    s = NativeStream(TokenClock(0.0))
    meta = {"prompt_tokens": 10, "cached_tokens": 6, "finish_reason": None}
    s.feed({"text": "a", "output_ids": [5], "meta_info": meta | {"completion_tokens": 1}}, 1.0)
    assert s.cached_tokens_details is None  # a server that does not split the hit
    meta["cached_tokens_details"] = {"device": 2, "host": 4, "storage": 0}
    with pytest.raises(StreamError, match="before the request finished"):
        s.check_finished()
    done = meta | {"completion_tokens": 3, "finish_reason": {"type": "length", "length": 3}}
    s.feed({"text": "abc", "output_ids": [5, 6, 7], "meta_info": done}, 2.0)
    s.check_finished()
    assert s.output_ids == [5, 6, 7] and s.completion_tokens == 3
    assert (s.prompt_tokens, s.cached_tokens) == (10, 6)
    assert s.cached_tokens_details == {"device": 2, "host": 4, "storage": 0}
    assert s.clock.ttft == 1.0 and s.clock.itls == pytest.approx([0.5, 0.5])
    s.feed({"meta_info": {"finish_reason": {"type": "abort", "message": "gone"}}}, 3.0)
    with pytest.raises(StreamError, match="gone"):
        s.check_finished()


def test_openai_stream_deltas_and_usage():
    s = OpenAIStream(TokenClock(0.0), requested_tokens=3)
    s.feed({"choices": [{"text": "", "finish_reason": None}]}, 0.5)  # a role/start event
    s.feed({"choices": [{"text": " a", "finish_reason": None}]}, 1.0)
    s.feed({"choices": [{"text": " b", "finish_reason": None}]}, 1.2)
    s.feed({"choices": [{"text": " c", "finish_reason": "length"}]}, 1.6)
    assert s.clock.ttft == 1.0 and s.clock.itls == pytest.approx([0.2, 0.4])
    assert s.output_tokens == 3 and s.cached_tokens is None
    s.feed({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 3,
                                     "prompt_tokens_details": {"cached_tokens": 16}}}, 1.7)
    assert (s.prompt_tokens, s.cached_tokens, s.output_tokens) == (20, 16, 3)
    s.check_finished()
    assert s.text == " a b c"


def test_openai_stream_without_usage_counts_by_finish():
    s = OpenAIStream(TokenClock(0.0), requested_tokens=8)
    s.feed({"choices": [{"text": "xé", "finish_reason": None}]}, 1.0)
    s.feed({"choices": [{"text": "", "finish_reason": "length"}]}, 1.1)
    assert s.output_tokens == 8  # a length finish means every asked token came
    t = OpenAIStream(TokenClock(0.0), requested_tokens=8)
    t.feed({"choices": [{"text": "x", "finish_reason": "stop"}]}, 1.0)
    assert t.output_tokens == 1
    u = OpenAIStream(TokenClock(0.0), requested_tokens=8)
    with pytest.raises(StreamError):
        u.check_finished()
