"""Incremental detokenization: output token ids in, text deltas out."""

from collections.abc import Sequence

from radixmesh.core.detokenize import MAX_PENDING_TOKENS, REPLACEMENT_CHAR, DecodeFn

# A UTF-8 character is at most 4 bytes, so an incomplete tail is at most 3 bytes long.
_MAX_CHAR_BYTES = 4


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, decoding only a small window."""

    def __init__(
        self,
        decode: DecodeFn,
        prompt_tail_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = decode
        self._skip_special_tokens = skip_special_tokens
        # Window of ids: [0:_read] is already emitted (left context), [_read:] is pending.
        # The window starts one emission back so the pending tokens decode as they would
        # mid-text (leading-space markers, byte merges across token boundaries).
        self._ids: list[int] = list(prompt_tail_ids)
        self._read = len(self._ids)
        self._finished = False
        self.text = ""

    def step(self, new_ids: Sequence[int]) -> str:
        """Appends new token ids and returns the newly completed text (may be empty)."""
        if self._finished:
            raise RuntimeError("step() after finish()")
        self._ids.extend(new_ids)
        prefix_text = self._text(self._ids[: self._read])
        full_text = self._text(self._ids)
        if full_text.endswith(REPLACEMENT_CHAR):
            if len(self._ids) - self._read > MAX_PENDING_TOKENS:
                return self._release_settled(prefix_text, full_text)
            return ""
        if len(full_text) <= len(prefix_text):
            # A token that decodes to nothing alone may still shape its neighbour (a leading
            # space marker at the start), so keep it, but forget a long run of such tokens
            # (skipped special tokens) so the window stays bounded.
            if full_text == prefix_text and len(self._ids) - self._read > MAX_PENDING_TOKENS:
                del self._ids[self._read :]
            return ""
        return self._emit(full_text[len(prefix_text) :], len(self._ids))

    def finish(self) -> str:
        """Flushes held-back text; an unfinished character comes out as U+FFFD."""
        if self._finished:
            return ""
        self._finished = True
        prefix_text = self._text(self._ids[: self._read])
        full_text = self._text(self._ids)
        return self._emit(full_text[len(prefix_text) :], len(self._ids))

    def _text(self, ids: list[int]) -> str:
        return self._decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _release_settled(self, prefix_text: str, full_text: str) -> str:
        """Emits the text that no later token can change, keeping the last few bytes."""
        split = len(self._ids) - 1
        while split > self._read and len(self._text(self._ids[split:])) < _MAX_CHAR_BYTES:
            split -= 1
        if split <= self._read:
            return ""
        # At least 4 bytes follow `split`, so the incomplete tail lies wholly after it and
        # later tokens cannot change the text before it, unless `split` cuts a character that
        # the following bytes complete; then `settled` is not a prefix of `full_text`.
        settled = self._text(self._ids[:split])
        if len(settled) <= len(prefix_text) or not full_text.startswith(settled):
            return ""
        return self._emit(settled[len(prefix_text) :], split)

    def _emit(self, delta: str, read: int) -> str:
        # The emitted tokens become the left context of the next window.
        del self._ids[: self._read]
        self._read = read - self._read
        self.text += delta
        return delta
