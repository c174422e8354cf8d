"""Speculative decoding on the engine core's side: which drafts a step verifies, how many the
workers propose next, what a verified step did to the books, and the counts for metrics.

The scheduler (`ringserve.engine.sched.scheduler`) holds one `SpecScheduling` when speculation
is on and meets it at four points: `drafts_for` while scheduling a running decode (the request
is then scheduled `1 + k` tokens, the drafts travel in `SchedulerOutput.spec_token_ids`, and the
blocks get `lookahead` extra slots for the draft model's writes), `num_to_propose` when the step
is built, `verified` for each request of a step's output (the computed count moves back over
the rejected drafts; only verified tokens ever reach the prefix cache), and `end_step` with the
drafts the workers proposed for the next step. Imports no torch.

**Never slower.** A draft costs verification work whether or not it is accepted: at batch 1
on a CPU a step's cost is the weights' bytes, almost the same for 1 row as for 5, but at large
batches the step is compute-bound and every rejected row is lost time. `DraftController`
measures, per decode batch size (in powers of two), the seconds per emitted token of steps that
verify and propose drafts and of steps that do neither (a step that switches between the two,
such as the draft model catching up on the tokens it missed while off, is not counted), and
proposes drafts only where they have been the faster; the mode
not in use is measured again now and then (every `EXPLORE_EVERY`-th step of that size while
the two are within `CLOSE_CALL` of each other, every `REVISIT_EVERY`-th when one is clearly
slower), so a change of workload turns speculation back on. A batch size never measured starts with
speculation (batch 1 speculates from its first decode step). `num_speculative_tokens_per_batch_size`
pins the number of drafts per batch size instead.
"""

from __future__ import annotations

import time

from ringserve.config import SpecDecodeConfig
from ringserve.engine.wire import SpecDecodingStats

EXPLORE_EVERY = 16  # steps of one batch size between two measurements of the mode not in use
# ... while the two are within this factor of each other; a mode clearly slower is measured
# again only every REVISIT_EVERY steps (switching a draft model back on costs a catch-up over
# every token it missed: trying it is not free).
CLOSE_CALL = 1.25
REVISIT_EVERY = 1024
_WEIGHT = 0.25  # the exponential average's weight of a new measurement


class DraftController:
    """How many drafts to propose for a decode batch of a given size (see the module).

    Args:
        max_drafts: `num_speculative_tokens`.
        pinned: (smallest batch size, drafts) pairs, ascending; when given, the controller
            follows them and measures nothing.
    """

    def __init__(self, max_drafts: int, pinned: tuple[tuple[int, int], ...] = ()) -> None:
        self.max_drafts = max_drafts
        self.pinned = pinned
        # bucket -> [seconds per token with drafts, without] (None: not measured yet)
        self._cost: dict[int, list[float | None]] = {}
        self._steps: dict[int, int] = {}

    def drafts_for_batch(self, batch: int) -> int:
        """The drafts each request of a `batch`-request decode step should get proposed."""
        if self.pinned:
            k = 0
            for size, drafts in self.pinned:
                if batch >= size:
                    k = drafts
            return min(k, self.max_drafts)
        bucket = _bucket(batch)
        cost = self._cost.get(bucket)
        if cost is None or cost[0] is None:
            return self.max_drafts
        if cost[1] is None:
            return 0  # measure the other mode once
        on = cost[0] <= cost[1]
        count = self._steps.get(bucket, 0) + 1
        self._steps[bucket] = count
        close = max(cost[0], cost[1]) < CLOSE_CALL * min(cost[0], cost[1])
        # Two steps in the other mode: the first switches (not measured), the second is one
        # of that mode's own.
        period = EXPLORE_EVERY if close else REVISIT_EVERY
        if count >= period and count % period < 2:
            on = not on
        return self.max_drafts if on else 0

    def observe(self, batch: int, with_drafts: bool, seconds: float, tokens: int) -> None:
        """A pure-decode step of `batch` requests took `seconds` and emitted `tokens`."""
        if self.pinned or tokens <= 0 or batch <= 0:
            return
        cost = self._cost.setdefault(_bucket(batch), [None, None])
        index = 0 if with_drafts else 1
        per_token = seconds / tokens
        old = cost[index]
        cost[index] = per_token if old is None else old + _WEIGHT * (per_token - old)


def _bucket(batch: int) -> int:
    return 1 << (batch - 1).bit_length()


class SpecScheduling:
    """The scheduler's speculative-decoding books (see the module docstring).

    Args:
        max_drafts: `num_speculative_tokens`.
        lookahead: extra KV slots per running request (a draft model writes past the
            verified tokens; 0 for n-gram drafts).
        pinned: `num_speculative_tokens_per_batch_size`, as (batch size, drafts) pairs.
    """

    def __init__(self, max_drafts: int, lookahead: int,
                 pinned: tuple[tuple[int, int], ...] = ()) -> None:
        self.max_drafts = max_drafts
        self.lookahead = lookahead
        self.controller = DraftController(max_drafts, pinned)
        self._drafts: dict[str, list[int]] = {}
        self._step_start = 0.0
        self._step_drafts = False
        self._step_batch = 0
        self._step_steady = False
        self._stats = SpecDecodingStats()

    @classmethod
    def from_config(cls, spec: SpecDecodeConfig | None) -> SpecScheduling | None:
        """The books for `--speculative-config` (None: speculation is off); a draft model
        gets `k` lookahead slots, n-gram drafts none."""
        if spec is None:
            return None
        k = spec.num_speculative_tokens
        return cls(k, lookahead=k if spec.uses_draft_model else 0, pinned=spec.per_batch_size)

    def drafts_for(self, request_id: str, room: int) -> list[int]:
        """The drafts a running decode verifies this step: at most `room` (what the token
        budget, max_tokens and max_model_len leave after its one token)."""
        drafts = self._drafts.pop(request_id, None)
        if not drafts or room <= 0:
            return []
        return drafts[:room]

    def begin_step(self, batch: int, with_drafts: bool) -> int:
        """A step of `batch` running requests is built: the drafts to propose for the next."""
        self._step_start = time.monotonic()
        self._step_drafts = with_drafts
        self._step_batch = batch
        k = self.controller.drafts_for_batch(batch)
        # A step that verifies drafts but proposes none, or proposes without verifying (the
        # draft model then catches up on every token it missed while off), is a switch
        # between the modes: its time belongs to neither.
        self._step_steady = (k > 0) == with_drafts
        return k

    def verified(self, num_drafts: int, num_emitted: int) -> int:
        """A request verified `num_drafts` drafts and emitted `num_emitted` tokens: the
        number of its scheduled positions that were rejected (its computed count moves back
        by that many)."""
        accepted = num_emitted - 1
        stats = self._stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += accepted
        per_pos = stats.num_accepted_tokens_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for position in range(accepted):
            per_pos[position] += 1
        return num_drafts - accepted

    def end_step(self, drafts: dict[str, list[int]], decode_only: bool, tokens: int) -> None:
        """A step's output arrived with `drafts` for the next; a pure-decode step's time and
        `tokens` emitted feed the controller."""
        self._drafts = dict(drafts)
        if decode_only and self._step_steady:
            self.controller.observe(self._step_batch, self._step_drafts,
                                    time.monotonic() - self._step_start, tokens)

    def forget(self, request_id: str) -> None:
        """A request left the running set (finished, aborted, preempted): no drafts."""
        self._drafts.pop(request_id, None)

    def take_stats(self) -> SpecDecodingStats | None:
        """The counts since the last call (None when no draft was verified)."""
        stats = self._stats
        if not stats.num_drafts:
            return None
        self._stats = SpecDecodingStats()
        return stats
