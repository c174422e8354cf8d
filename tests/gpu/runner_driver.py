"""A toy scheduler that drives a ModelRunner in tests: FCFS under a token budget (so long
prompts are chunked), blocks handed out from a counter, and prefix reuse of full blocks whose
KV was computed earlier (a prefix-cache hit: the new request starts with num_computed > 0)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.gpu.runner.model_runner import ModelRunner
from ringserve.gpu.wire import (
    CachedRequestData,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from ringserve.sampling_params import SamplingParams


@dataclass
class ToyRequest:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class ToyScheduler:
    def __init__(self, runner: ModelRunner, *, budget: int = 64, prefix_caching: bool = True) -> None:
        self.runner = runner
        self.block_size = runner.config.cache_config.block_size
        self.budget = budget
        self.prefix_caching = prefix_caching
        self.next_block = 1
        self.cached_blocks: dict[tuple[int, ...], int] = {}
        self.running: list[ToyRequest] = []
        self.done: dict[str, ToyRequest] = {}
        self.finished_ids: list[str] = []
        self.step_id = 0
        self.prefix_hits = 0
        self.outputs: list[ModelRunnerOutput] = []

    def add(self, req_id: str, prompt: list[int], params: SamplingParams, max_tokens: int) -> None:
        req = ToyRequest(req_id, list(prompt), params, max_tokens)
        if self.prefix_caching:
            self._reuse_prefix(req)
        self.running.append(req)

    def _reuse_prefix(self, req: ToyRequest) -> None:
        bs = self.block_size
        for k in range(1, (len(req.prompt) - 1) // bs + 1):
            block = self.cached_blocks.get(tuple(req.prompt[: k * bs]))
            if block is None:
                break
            req.blocks.append(block)
            req.num_computed = k * bs
        if req.num_computed:
            self.prefix_hits += 1

    def run(self) -> dict[str, list[int]]:
        while self.running:
            self.step()
        return {r: req.output for r, req in self.done.items()}

    def step(self) -> ModelRunnerOutput:
        budget = self.budget
        new: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        sched: dict[str, int] = {}
        for req in self.running:
            n = min(len(req.tokens) - req.num_computed, budget)
            if n <= 0:
                continue
            need = -(-(req.num_computed + n) // self.block_size) - len(req.blocks)
            fresh = list(range(self.next_block, self.next_block + need))
            self.next_block += need
            req.blocks += fresh
            if req.sent:
                cached.append(CachedRequestData(req.req_id, req.num_computed, fresh))
            else:
                new.append(NewRequestData(req.req_id, req.prompt, req.params, list(req.blocks),
                                          req.num_computed))
                req.sent = True
            sched[req.req_id] = n
            budget -= n
        so = SchedulerOutput(self.step_id, new, cached, sched, sum(sched.values()),
                             self.finished_ids)
        self.finished_ids = []
        self.step_id += 1
        out = self.runner.execute_model(so)
        self.outputs.append(out)
        self._update(out, sched)
        return out

    def _update(self, out: ModelRunnerOutput, sched: dict[str, int]) -> None:
        by_id = {r.req_id: r for r in self.running}
        row = 0
        for req_id, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            req = by_id[req_id]
            req.num_computed += sched[req_id]
            self._register_blocks(req)
            if toks:
                req.output += toks
                if out.logprobs is not None and req.params.logprobs is not None:
                    lp = out.logprobs
                    req.logprobs.append(Logprobs(lp.token_ids[row], lp.logprobs[row], lp.ranks[row]))
                row += len(toks)
            if req_id in out.prompt_logprobs:
                req.prompt_logprobs.append(out.prompt_logprobs[req_id])
        for req_id in self.runner.request_errors:
            if req_id in by_id:
                self._finish(by_id[req_id])
        for req in list(self.running):
            if len(req.output) >= req.max_tokens:
                self._finish(req)

    def _register_blocks(self, req: ToyRequest) -> None:
        bs = self.block_size
        for k in range(min(req.num_computed, len(req.prompt)) // bs):
            self.cached_blocks.setdefault(tuple(req.prompt[: (k + 1) * bs]), req.blocks[k])

    def _finish(self, req: ToyRequest) -> None:
        self.running.remove(req)
        self.done[req.req_id] = req
        self.finished_ids.append(req.req_id)
