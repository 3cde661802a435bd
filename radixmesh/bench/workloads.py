"""Benchmark workloads, generated offline from the model's tokenizer with a fixed seed.

Every workload is a list of conversations; random and shared-prefix prompts are
conversations of one turn. Prompts are drawn from whole-word tokens whose text
re-tokenizes to the same ids, so a server that only takes text sees the same prompt."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from radixmesh.core.tokenizer import Tokenizer

_WORD = re.compile(r" [a-z]{3,12}")
MIN_POOL = 500


@dataclass(frozen=True)
class Turn:
    """What one turn appends to the conversation, and how many tokens it asks for."""

    new_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class Conversation:
    """Turns sent in order; turn k resends every earlier turn with its answer."""

    turns: list[Turn]


@dataclass(frozen=True)
class Workload:
    """A named set of conversations and the knobs that made it."""

    name: str
    conversations: list[Conversation]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        """Requests the workload sends, every turn counted."""
        return sum(len(c.turns) for c in self.conversations)

    @property
    def num_turns(self) -> int:
        """The most turns any conversation has."""
        return max((len(c.turns) for c in self.conversations), default=0)


def word_pool(tokenizer: Tokenizer) -> list[int]:
    """Ids of lower-case word tokens (with a leading space) that re-tokenize to themselves."""
    raw = tokenizer.raw
    texts = raw.decode_batch([[i] for i in range(tokenizer.vocab_size)])
    candidates = [(i, t) for i, t in enumerate(texts) if _WORD.fullmatch(t)]
    encoded = raw.encode_batch([t for _, t in candidates], add_special_tokens=False)
    pool = [i for (i, _), enc in zip(candidates, encoded, strict=True) if enc.ids == [i]]
    if len(pool) < MIN_POOL:
        raise ValueError(f"the tokenizer has only {len(pool)} plain word tokens; "
                         f"at least {MIN_POOL} are needed to draw prompts")
    return pool


def _lengths(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    """n lengths drawn uniformly from [length * range_ratio, length] (at least 1)."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(length * range_ratio))
    return [rng.randint(low, max(low, length)) for _ in range(n)]


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def random_workload(
    pool: list[int], seed: int, num_prompts: int, input_len: int, output_len: int,
    range_ratio: float = 1.0,
) -> Workload:
    """Independent prompts of random words; lengths vary down to range_ratio of the given."""
    _positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    rng = random.Random(seed)
    inputs = _lengths(rng, num_prompts, input_len, range_ratio)
    outputs = _lengths(rng, num_prompts, output_len, range_ratio)
    conversations = [Conversation([Turn(rng.choices(pool, k=i), o)])
                     for i, o in zip(inputs, outputs, strict=True)]
    params = {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
              "range_ratio": range_ratio}
    return Workload("random", conversations, params)


def shared_prefix_workload(
    pool: list[int], seed: int, num_groups: int, prompts_per_group: int, system_prompt_len: int,
    question_len: int, output_len: int,
) -> Workload:
    """Groups of prompts that share a system prompt and differ in their question, shuffled."""
    _positive(num_groups=num_groups, prompts_per_group=prompts_per_group,
              system_prompt_len=system_prompt_len, question_len=question_len,
              output_len=output_len)
    rng = random.Random(seed)
    conversations = []
    for _ in range(num_groups):
        system = rng.choices(pool, k=system_prompt_len)
        conversations += [Conversation([Turn(system + rng.choices(pool, k=question_len),
                                             output_len)])
                          for _ in range(prompts_per_group)]
    # Arrival order mixes the groups, as independent users of a few system prompts would.
    rng.shuffle(conversations)
    params = {"num_groups": num_groups, "prompts_per_group": prompts_per_group,
              "system_prompt_len": system_prompt_len, "question_len": question_len,
              "output_len": output_len}
    return Workload("shared-prefix", conversations, params)


def multi_turn_workload(
    pool: list[int], seed: int, num_conversations: int, num_turns: int, first_len: int,
    question_len: int, output_len: int,
) -> Workload:
    """Chats that open with a long first message (a document) and go on with short questions."""
    _positive(num_conversations=num_conversations, num_turns=num_turns, first_len=first_len,
              question_len=question_len, output_len=output_len)
    rng = random.Random(seed)
    conversations = []
    for _ in range(num_conversations):
        turns = [Turn(rng.choices(pool, k=first_len), output_len)]
        turns += [Turn(rng.choices(pool, k=question_len), output_len)
                  for _ in range(num_turns - 1)]
        conversations.append(Conversation(turns))
    params = {"num_conversations": num_conversations, "num_turns": num_turns,
              "first_len": first_len, "question_len": question_len, "output_len": output_len}
    return Workload("multi-turn", conversations, params)
