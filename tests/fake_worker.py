"""A model-free worker that runs StepBatches and checks KV bookkeeping.

Its "KV pool" records which (token, position) each slot holds; every step it checks that
each request's slots hold exactly that request's tokens, so a slot handed out twice, a
wrong cached prefix or a stale slot fails loudly. The next token is a function of the
whole sequence, as a real model's would be.

With `host_slots`, it has a host pool too: loads copy host slots into device slots before
the step, and each backup copies its device slots to the host only `ack_delay` steps
later (then reports it done), the latest a real worker may: a device slot the scheduler
freed or reused before the acknowledgement would put the wrong KV in the host tier, and
the load of it would fail the step's check.

With `jump`, it forces tokens after some sampled ones of constrained requests (JUMPING's) as
the runner's jump-forward does:
they come back with the sampled token, and the entry the scheduler had already scheduled
for the request (no input_ids) feeds the sampled token without sampling.

Constraints the scheduler asks for "compile" in `compile_steps` steps; those in `broken`
fail.

Packed decodes (StepBatch.decode_rows) run as entries of their rows' requests would; every
row must belong to one live request.

An entry with a draft tree gets it verified as the runner does: every draft token's K/V is
written at the position its depth gives, the path the model (`model`, next_token by
default) agrees with is accepted, and its K/V moves to the first draft slots."""

from __future__ import annotations

from collections.abc import Callable

from radixmesh.core.step import (
    Constraint,
    EntryResult,
    KVCopy,
    StepBatch,
    StepEntry,
    StepResult,
    int_array,
)

VOCAB = 50
# A constraint the fake worker compiles and lets `jump` force tokens under.
JUMPING = ("regex", "[0-9]+")

# Jump-forward as a grammar would do it: the tokens forced after a sequence that ends with a
# sampled token.
Jump = Callable[[list[int]], list[int]]
# The next token after a sequence.
Model = Callable[[list[int]], int]


def next_token(tokens: list[int]) -> int:
    """Deterministic stand-in for greedy decoding."""
    h = len(tokens)
    for t in tokens[-4:]:
        h = (h * 31 + t) % 1000003
    return h % VOCAB


class FakeWorker:
    """Mirrors the model runner's per-request state and checks every slot it reads."""

    def __init__(
        self, num_slots: int, host_slots: int = 0, ack_delay: int = 0, jump: Jump | None = None,
        compile_steps: int = 0, broken: frozenset[Constraint] = frozenset(),
        model: Model = next_token,
    ) -> None:
        self.jump = jump
        self.model = model
        self.accepted = 0  # draft tokens accepted
        self.compile_steps, self.broken = compile_steps, broken
        self.compiling: list[tuple[int, Constraint]] = []  # (step it is done at, constraint)
        self.sampled: dict[str, int] = {}  # tokens sampled per request (its first: admitted)
        self.jumped: set[str] = set()  # requests whose forced tokens are not fed yet
        self.pool: list[tuple[int, int] | None] = [None] * num_slots
        self.host: list[tuple[int, int] | None] = [None] * host_slots
        self.reqs: dict[str, tuple[list[int], list[int], list[int]]] = {}  # ids, slots, last
        self.rows: dict[int, str] = {}  # request-table row -> its request
        self.constrained: set[str] = set()  # requests jump-forward may force tokens for
        self.steps = 0
        self.ack_delay = ack_delay
        self.backups: list[tuple[int, KVCopy]] = []  # (step it completes at, copy)
        self.copied = {"to_host": 0, "to_device": 0}  # tokens

    def forward(self, batch: StepBatch) -> StepResult:
        self.steps += 1
        for rid in batch.release:
            del self.reqs[rid]
            self.jumped.discard(rid)
            self.constrained.discard(rid)
            self.rows = {row: r for row, r in self.rows.items() if r != rid}
        for new in batch.new_requests:
            assert new.rid not in self.reqs, f"{new.rid} admitted twice"
            assert new.row >= 0 and new.row not in self.rows, f"{new.rid}: row {new.row} taken"
            self.rows[new.row] = new.rid
            if new.params.grammar is not None:
                self.constrained.add(new.rid)
            # Prefix slots may be written by this very step (a prefix shared within the
            # batch), so they are checked with the rest after the step's writes.
            self.reqs[new.rid] = (list(new.prefix_ids), list(new.prefix_slots), [-1])
        for copy in batch.copies:
            if not copy.to_host:
                for dev, host in zip(copy.device_slots, copy.host_slots, strict=True):
                    assert self.host[host] is not None, f"load of empty host slot {host}"
                    self.pool[dev] = self.host[host]
                self.copied["to_device"] += len(copy.device_slots)
        result = StepResult(batch.step)
        self.compiling.extend((self.steps + self.compile_steps, g) for g in batch.grammars)
        for due, grammar in list(self.compiling):
            if due <= self.steps:
                self.compiling.remove((due, grammar))
                if grammar in self.broken:
                    result.grammars_failed.append((grammar, "broken"))
                else:
                    result.grammars_ready.append(grammar)
        written: set[int] = set()
        void: set[str] = set()
        packed = [StepEntry(self.rows[row], [], [slot], True)
                  for row, slot in zip(batch.decode_rows, batch.decode_slots, strict=True)]
        assert not any(e.rid in self.jumped for e in packed), "a packed decode after a jump"
        entries = [*packed, *batch.entries]
        for entry in entries:
            ids, slots, last = self.reqs[entry.rid]
            if entry.rid in self.jumped and not entry.input_ids:
                void.add(entry.rid)
            self.jumped.discard(entry.rid)
            new_ids = entry.input_ids or [last[0]]
            assert new_ids[0] >= 0, f"{entry.rid}: decode before any token was sampled"
            assert len(entry.slots) == len(new_ids) + len(entry.draft)
            for tok, slot in zip(new_ids, entry.slots[: len(new_ids)], strict=True):
                assert slot not in written, f"slot {slot} written twice in one step"
                written.add(slot)
                self.pool[slot] = (tok, len(ids))
                ids.append(tok)
                slots.append(slot)
            depth: list[int] = []
            for k, parent in enumerate(entry.draft_parents):
                assert -1 <= parent < k, f"{entry.rid}: draft node {k} before its parent"
                depth.append(1 if parent < 0 else depth[parent] + 1)
                slot = entry.slots[len(new_ids) + k]
                assert slot not in written, f"slot {slot} written twice in one step"
                written.add(slot)
                self.pool[slot] = (entry.draft[k], len(ids) - 1 + depth[k])
        for entry in entries:
            ids, slots, last = self.reqs[entry.rid]
            for pos, slot in enumerate(slots):
                assert self.pool[slot] == (ids[pos], pos), (
                    f"{entry.rid}: slot {slot} holds {self.pool[slot]}, expected {(ids[pos], pos)}"
                )
            out = EntryResult(entry.rid)
            result.results.append(out)
            if entry.sample and entry.rid not in void and entry.draft:
                last[0] = out.token_id = self._verify(entry, ids, slots, out)
                self.sampled[entry.rid] = self.sampled.get(entry.rid, 0) + 1
            elif entry.sample and entry.rid not in void:
                last[0] = out.token_id = self.model(ids)
                self.sampled[entry.rid] = self.sampled.get(entry.rid, 0) + 1
                if self.jump is not None and entry.rid in self.constrained:
                    out.forced_ids = self.jump([*ids, out.token_id])
                    if out.forced_ids:
                        self.jumped.add(entry.rid)
        # Timed as a small CPU would run it: a row costs a fifth of a one-row step.
        result.forward_ms = 4.0 + sum(len(e.slots) for e in entries)
        result.decode_tokens = int_array(r.token_id for r in result.results[: len(packed)])
        del result.results[: len(packed)]
        self.backups.extend((self.steps + self.ack_delay, c) for c in batch.copies if c.to_host)
        for due, copy in list(self.backups):
            if due <= self.steps:
                for dev, host in zip(copy.device_slots, copy.host_slots, strict=True):
                    self.host[host] = self.pool[dev]
                self.copied["to_host"] += len(copy.device_slots)
                result.copies_done.append(copy.copy_id)
                self.backups.remove((due, copy))
        return result

    def _verify(self, entry: StepEntry, ids: list[int], slots: list[int], out: EntryResult) -> int:
        """Accept the draft path the model agrees with; returns the model's token after it."""
        kids = {(p, t): k for k, (t, p) in enumerate(zip(entry.draft, entry.draft_parents,
                                                           strict=True))}
        node_slots = entry.slots[len(entry.slots) - len(entry.draft) :]
        at, path = -1, []
        while (child := kids.get((at, self.model(ids + out.accepted_ids)))) is not None:
            path.append(child)
            out.accepted_ids.append(entry.draft[child])
            at = child
        moved = [self.pool[node_slots[k]] for k in path]
        for j, kv in enumerate(moved):
            self.pool[node_slots[j]] = kv
        for j, tok in enumerate(out.accepted_ids):
            assert self.pool[node_slots[j]] == (tok, len(ids)), "accepted K/V in the wrong place"
            ids.append(tok)
            slots.append(node_slots[j])
        self.accepted += len(path)
        return self.model(ids)


def reference_output(
    prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = (),
    jump: Jump | None = None, model: Model = next_token,
) -> list[int]:
    """What a request alone would produce with the fake model."""
    tokens, out = list(prompt), []
    while len(out) < max_new_tokens:
        tok = model(tokens)
        out.append(tok)
        tokens.append(tok)
        if tok in stop_ids:
            break
        for forced in jump(tokens) if jump is not None else []:
            if len(out) == max_new_tokens:
                break
            out.append(forced)
            tokens.append(forced)
    return out
