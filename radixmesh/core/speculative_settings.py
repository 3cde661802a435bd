"""Speculative decoding's settings (SGLang's names): how drafts are made from an n-gram store
and verified by the model (`radixmesh.engine.speculation`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from radixmesh.core.flags import Settings, setting

SPECULATIVE_ALGORITHMS = ("NGRAM",)
NGRAM_MATCH_TYPES = ("BFS", "PROB")


@dataclass(frozen=True, kw_only=True)
class SpeculativeSettings(Settings):
    """Speculative decoding: drafts from an n-gram store, verified by the model (SGLang's
    names)."""

    TITLE: ClassVar[str] = "speculative decoding"

    speculative_algorithm: str | None = setting(
        None,
        choices=SPECULATIVE_ALGORITHMS,
        help="NGRAM: guess the next tokens from what the request's prompt and output and the "
        "engine's recent output continued the same words with, and verify the guesses in one "
        "forward (greedy output is unchanged, sampling keeps its distribution); empty: off",
    )
    speculative_num_draft_tokens: int = setting(
        8,
        minimum=1,
        help="most draft tokens verified for a request in one step (the draft tree's size)",
    )
    speculative_ngram_min_match_window_size: int = setting(
        1,
        minimum=1,
        help="fewest trailing tokens of a request that must match the n-gram store to draft",
    )
    speculative_ngram_max_match_window_size: int = setting(
        12,
        minimum=1,
        help="most trailing tokens matched against the n-gram store (the longest match wins)",
    )
    speculative_ngram_min_bfs_breadth: int = setting(
        1,
        minimum=1,
        help="branches a draft tree takes at a node after a long match, and below its first "
        "level",
    )
    speculative_ngram_max_bfs_breadth: int = setting(
        10,
        minimum=1,
        help="branches a draft tree takes at its root after the shortest match (the breadth "
        "narrows as the match grows longer)",
    )
    speculative_ngram_match_type: str = setting(
        "BFS",
        choices=NGRAM_MATCH_TYPES,
        help="how the draft tree is grown: BFS (level by level, the most recent continuations "
        "first) or PROB (the most frequent paths first)",
    )
    speculative_ngram_branch_length: int = setting(
        18,
        minimum=1,
        help="most draft tokens along one branch of the tree",
    )
    speculative_ngram_max_trie_depth: int = setting(
        18,
        minimum=2,
        help="longest token sequence the n-gram store keeps (match window plus continuation)",
    )
    speculative_ngram_capacity: int = setting(
        1_000_000,
        minimum=1000,
        help="most nodes the engine's n-gram store holds; beyond it the oldest half is dropped",
    )

    def cross_check(self) -> None:
        super().cross_check()
        lo, hi = (self.speculative_ngram_min_match_window_size,
                  self.speculative_ngram_max_match_window_size)
        if lo > hi:
            raise ValueError(
                f"speculative_ngram_min_match_window_size ({lo}) must not exceed "
                f"speculative_ngram_max_match_window_size ({hi})"
            )
        if self.speculative_ngram_min_bfs_breadth > self.speculative_ngram_max_bfs_breadth:
            raise ValueError(
                f"speculative_ngram_min_bfs_breadth ({self.speculative_ngram_min_bfs_breadth}) "
                "must not exceed speculative_ngram_max_bfs_breadth "
                f"({self.speculative_ngram_max_bfs_breadth})"
            )
        if self.speculative_ngram_max_trie_depth <= hi:
            raise ValueError(
                f"speculative_ngram_max_trie_depth ({self.speculative_ngram_max_trie_depth}) "
                f"must exceed speculative_ngram_max_match_window_size ({hi}): a match needs "
                "room for a continuation"
            )
