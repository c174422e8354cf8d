"""Fan-out of an n > 1 request into n child requests, and the merge of their outputs.

The frontend sends each child to the core as its own request (`"{i}_{internal_id}"`, where the
internal id is the frontend's unique id for the user's request, with the seed advanced by i
when one is set, as vLLM does); the output processor merges the children's
CompletionOutputs back into one RequestOutput per the parent's output kind.
"""

from __future__ import annotations

from ringserve.outputs import CompletionOutput
from ringserve.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """The n children of one user request and their latest outputs.

    Args:
        request_id: the user's request id (echoed in outputs; not necessarily unique).
        params: the user's sampling parameters (n > 1).
        internal_id: the frontend's unique id for this request (default: `request_id`); the
            children's ids derive from it, so they never collide with another request's.
    """

    def __init__(self, request_id: str, params: SamplingParams,
                 internal_id: str | None = None) -> None:
        self.request_id = request_id
        self.internal_id = request_id if internal_id is None else internal_id
        self.params = params
        self.child_ids = [f"{i}_{self.internal_id}" for i in range(params.n)]
        self._latest: list[CompletionOutput | None] = [None] * params.n
        self._finished = [False] * params.n

    def child_params(self, index: int) -> SamplingParams:
        """Sampling parameters of child `index`: n=1, seed + index when seeded."""
        seed = None if self.params.seed is None else self.params.seed + index
        return self.params.clone(n=1, seed=seed)

    @property
    def all_finished(self) -> bool:
        """True once every child has finished."""
        return all(self._finished)

    def merge(
        self, index: int, completion: CompletionOutput | None, finished: bool,
        kind: RequestOutputKind,
    ) -> tuple[list[CompletionOutput] | None, bool]:
        """Record child `index`'s output; returns (completions to report or None, finished)."""
        self._finished[index] = self._finished[index] or finished
        if completion is not None:
            self._latest[index] = completion
        done = self.all_finished
        if kind is RequestOutputKind.DELTA:
            return ([completion] if completion is not None else None), done
        if kind is RequestOutputKind.FINAL_ONLY:
            if not done:
                return None, False
            return [c for c in self._latest if c is not None], True
        if completion is None:
            return None, done
        return [c for c in self._latest if c is not None], done
