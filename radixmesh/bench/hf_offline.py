"""Hugging Face transformers `generate` as the plain offline baseline over the same workloads.

No server and no prefix cache: up to `concurrency` conversations form one static batch
(left-padded with EOS), their turns run in lockstep, each batch generates the longest
output any member asks for (greedy, that many tokens exactly). A request's TTFT is its
batch's first token after the batch started; its latency ends at its own last token."""

from __future__ import annotations

import time
from typing import Any

from radixmesh.bench.runner import RunResult
from radixmesh.bench.stats import RequestResult
from radixmesh.bench.workloads import Workload


class _StepClock:
    """A `generate` streamer that only notes when each step's tokens arrive."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True  # the first call hands over the prompt itself

    def end(self) -> None:
        """Nothing is held back."""


class HFGenerator:
    """The model loaded by transformers, generating exact-length greedy batches."""

    def __init__(self, model_path: str | None = None, dtype: str = "bfloat16",
                 threads: int | None = None) -> None:
        import torch
        import transformers

        from radixmesh.core.model_files import is_gguf, resolve_model_path

        if threads:
            torch.set_num_threads(threads)
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        path = resolve_model_path(model_path)
        kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
        if is_gguf(path):
            source, kwargs["gguf_file"] = str(path.parent), path.name
        else:
            source = str(path)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(source, **kwargs).eval()
        eos = self.model.config.eos_token_id
        self.pad = int(eos[0] if isinstance(eos, list) else eos)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]],
                                                                            list[float]]:
        """Each prompt's new token ids, and when each step's tokens arrived."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        clock = _StepClock()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      pad_token_id=self.pad, streamer=clock)
        return out[:, width:].tolist(), clock.times


def run_offline(gen: HFGenerator, workload: Workload, concurrency: int) -> RunResult:
    """Every conversation of the workload, `concurrency` at a time, as static batches."""
    convs = list(enumerate(workload.conversations))
    results: list[RequestResult] = []
    started = time.perf_counter()
    for first in range(0, len(convs), concurrency):
        group = convs[first:first + concurrency]
        history: dict[int, list[int]] = {i: [] for i, _ in group}
        for number in range(1, max(len(c.turns) for _, c in group) + 1):
            members = [(i, c.turns[number - 1]) for i, c in group if len(c.turns) >= number]
            prompts = [history[i] + turn.new_ids for i, turn in members]
            batch_start = time.perf_counter()
            outputs, times = gen.generate(prompts, max(t.output_len for _, t in members))
            for (i, turn), prompt, output in zip(members, prompts, outputs, strict=True):
                n = turn.output_len
                results.append(RequestResult(
                    i, number, len(prompt), n, output_tokens=n, prompt_tokens=len(prompt),
                    ttft=times[0] - batch_start, latency=times[n - 1] - batch_start,
                    itls=[b - a for a, b in zip(times[:n - 1], times[1:n], strict=True)],
                ))
                history[i] = prompt + output[:n]
    return RunResult(results, time.perf_counter() - started)
