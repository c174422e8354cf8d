"""Weights from a trainer, end to end (issue 18): a real training loop on the tiny Llama pushes
its weights after every optimiser step through each CPU backend (shm, gloo), at TP 1 and 2, and
ringserve's greedy tokens and logprobs then equal transformers run with the trainer's current
weights; versions across an update; a mismatched source; a worker SIGKILLed mid-update."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM

from ringserve import SamplingParams
from ringserve.engine.arg_utils import EngineArgs
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.frontend.llm import LLM
from ringserve.weight_transfer import (
    ModuleWeightSource,
    SharedWeights,
    StateDictSource,
    TrainerWeightTransferEngine,
)

PROMPTS = [[5, 17, 42, 99, 7], [300, 301, 302]]
TARGET = [11, 12, 13, 14]  # the completion the training loop pushes the model toward
KEPT_TOKENS = 120
ENGINE = {"device": "cpu", "kv_cache_memory": 16 << 20, "max_num_seqs": 8,
          "max_num_batched_tokens": 64, "max_model_len": 256}


def _train_step(model: Any, opt: torch.optim.Optimizer) -> float:
    """One step of cross-entropy on PROMPTS[0] + TARGET (the target tokens only)."""
    ids = torch.tensor([PROMPTS[0] + TARGET])
    logits = model(ids).logits[0, len(PROMPTS[0]) - 1:-1]
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(TARGET))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def _hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens,
                                                                              strict=True)]
    return tokens, logprobs


def _check_matches(llm: LLM, model: Any, version: str | None) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        tokens, logprobs = _hf_greedy(model, prompt, 6)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        got = [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]
        assert got == pytest.approx(logprobs, abs=2e-4)
        assert [(s.version, s.start) for s in completion.weight_versions] == [(version, 0)]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "tp", "family"),
                         [("shm", 1, "llama"), ("gloo", 1, "llama"), ("shm", 2, "qwen2"),
                          ("shm-shared", 1, "llama"), ("shm-shared", 2, "qwen2"),
                          ("shm-shared", 1, "qwen2")])
def test_training_loop_pushes_weights(backend: str, tp: int, family: str,
                                      request: pytest.FixtureRequest) -> None:
    """"shm-shared": the trainer's parameters live in shared memory (`SharedWeights`), and
    the workers read them in place, every bucket of every round."""
    model_dir: Path = request.getfixturevalue(f"tiny_{family}_dir")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    shared = SharedWeights(model) if backend == "shm-shared" else None
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    config = {"backend": backend.removesuffix("-shared"), "bucket_bytes": 1 << 20}  # buckets
    with contextlib.ExitStack() as stack:
        if shared is not None:
            stack.enter_context(shared)
        llm = stack.enter_context(LLM(str(model_dir), tensor_parallel_size=tp,
                                      weight_transfer_config=config, **ENGINE))
        _check_matches(llm, model, None)
        with TrainerWeightTransferEngine(config, llm) as trainer:
            trainer.trainer_init(shared or ModuleWeightSource(model))
            losses = []
            for step in range(1, 4):
                losses.append(_train_step(model, opt))
                model.eval()
                assert trainer.send_weights() == str(step)
                if shared is not None:  # no bucket was copied
                    sender = trainer._transport
                    assert sender is not None and sender.sent_in_place > 1  # type: ignore
                    assert all(shared.offset_of(p) is not None for p in model.parameters())
                assert llm.get_weight_version() == str(step)
                _check_matches(llm, model, str(step))
                model.train()
        assert losses[-1] < losses[0]


def _engine_request(llm: LLM, rid: str, prompt: list[int], n: int) -> None:
    llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))


def _run_until(llm: LLM, rid: str, min_tokens: int | None) -> Any:
    """Step the engine until `rid` has `min_tokens` tokens (None: until it finishes)."""
    while True:
        for output in llm.llm_engine.step():
            if output.request_id != rid:
                continue
            if output.finished or (min_tokens is not None
                                   and len(output.outputs[0].token_ids) >= min_tokens):
                return output


@pytest.mark.slow
def test_request_kept_across_an_update_reports_both_versions(tiny_llama_dir: Path) -> None:
    """A request running while new weights land recomputes its KV with them: its tokens after
    the update are what transformers with the new weights continues its prefix with."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    with LLM(str(tiny_llama_dir), weight_transfer_config={"backend": "shm"}, **ENGINE) as llm, \
            TrainerWeightTransferEngine({"backend": "shm"}, llm) as trainer:
        trainer.trainer_init(ModuleWeightSource(model))
        # Long enough that it cannot finish before the pause: the core runs on by itself.
        _engine_request(llm, "kept", PROMPTS[0], KEPT_TOKENS)
        first = _run_until(llm, "kept", 4).outputs[0].token_ids
        llm.pause("keep")
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)  # different weights, still a sane model
        trainer.send_weights("v1")
        llm.resume()
        final = _run_until(llm, "kept", None).outputs[0]
    k = len(first)
    assert final.token_ids[:k] == first
    spans = [(s.version, s.start) for s in final.weight_versions]
    assert spans[0] == (None, 0) and spans[-1][0] == "v1" and len(spans) == 2
    cut = spans[1][1]
    assert cut >= k
    expected, _ = _hf_greedy(model, PROMPTS[0] + final.token_ids[:cut], KEPT_TOKENS - cut)
    assert final.token_ids[cut:] == expected


@pytest.mark.slow
def test_mismatched_source_is_refused_before_any_copy(tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    good = dict(model.state_dict())
    wrong_shape = {**good, "model.norm.weight": torch.ones(3)}
    unknown = {**good, "model.layers.0.mlp.extra.weight": torch.ones(2, 2)}
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    not_float = {**good, "model.norm.weight": torch.ones(64, dtype=torch.int64)}
    with LLM(str(tiny_llama_dir), weight_transfer_config={"backend": "shm"}, **ENGINE) as llm:
        before = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                              SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
        for source, needle in ((wrong_shape, "model.norm.weight': shape [3]"),
                               (unknown, "extra.weight' matches no parameter"),
                               (missing, "lacks 1 tensors"),
                               (not_float, "dtype torch.int64")):
            with TrainerWeightTransferEngine({"backend": "shm"}, llm) as trainer:
                trainer.trainer_init(StateDictSource(source))
                with pytest.raises(ValueError, match="do not match the model") as info:
                    trainer.send_weights()
                assert needle in str(info.value)
        assert llm.get_weight_version() is None
        with pytest.raises(ValueError, match="call start_weight_update first"):
            llm.update_weights({})
        with pytest.raises(ValueError, match="no weight update is in progress"):
            llm.finish_weight_update("v9")
        after = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                             SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
        assert after[0].outputs[0].token_ids == before[0].outputs[0].token_ids


def test_weight_routes_need_a_transport(tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), **ENGINE) as llm:
        with pytest.raises(ValueError, match="--weight-transfer-config"):
            llm.init_weight_transfer_engine({})
        assert llm.collective_rpc("get_device_info")[0]["rank"] == 0
        with pytest.raises(ValueError, match="not allowed"):
            llm.collective_rpc("load_model")
        with pytest.raises(ValueError, match="takes no arguments"):
            llm.collective_rpc("get_device_info", [1])
        assert len(llm.collective_rpc("get_weight_checksum")[0]) == 64


# -- a worker SIGKILLed mid-update ----------------------------------------------------------------


def _worker_pids(llm: AsyncLLM) -> list[int]:
    assert llm.client is not None
    core = llm.client.processes[0].pid
    kids: list[int] = []
    for task in Path(f"/proc/{core}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return [pid for pid in kids
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ringserve::Worker_TP")]


class _FromThread:
    """AsyncLLM as a sync client for a trainer running in a worker thread of trio."""

    def __init__(self, llm: AsyncLLM, token: trio.lowlevel.TrioToken,
                 before_update: Any = None) -> None:
        self.llm = llm
        self.before_update = before_update
        self.token = token  # the trainer may call from threads of its own

    def _run(self, fn: Any, *args: Any) -> Any:
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._run(self.llm.init_weight_transfer_engine, init_info)

    def start_weight_update(self, metadata: dict[str, Any] | None = None) -> None:
        self._run(self.llm.start_weight_update, metadata)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if self.before_update is not None:
            self.before_update()
        self._run(self.llm.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.llm.finish_weight_update, weight_version)


@pytest.mark.slow
async def test_worker_killed_mid_update(tiny_llama_dir: Path) -> None:
    """A worker SIGKILLed during round 2: the update fails at once with an error, the engine
    reports the fault (unhealthy), and `retry` brings it back on round 1's weights (the last
    complete ones, from the snapshot) under round 1's version, never a half-updated model;
    a sleep at level 2 and a wake-up keep them too."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    args = EngineArgs(model=str(tiny_llama_dir), distributed_executor_backend="mp",
                      weight_transfer_config={"backend": "shm"}, **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def tokens(llm: AsyncLLM) -> list[int]:
        outs = [o async for o in llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy)]
        return list(outs[-1].outputs[0].token_ids)

    def scale(factor: float) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(factor)

    async with AsyncLLM.from_engine_args(args) as llm:
        killed: list[int] = []

        def kill_worker() -> None:
            if not killed:
                killed.append(_worker_pids(llm)[0])
                os.kill(killed[0], signal.SIGKILL)

        with TrainerWeightTransferEngine({"backend": "shm"}, _FromThread(
                llm, trio.lowlevel.current_trio_token())) as trainer:
            scale(0.5)
            await trio.to_thread.run_sync(trainer.trainer_init, ModuleWeightSource(model))
            await trio.to_thread.run_sync(trainer.send_weights, "v1")
            v1 = await tokens(llm)
            assert v1 == _hf_greedy(model, PROMPTS[0], 6)[0]
            scale(0.5)
            trainer.client = _FromThread(llm, trio.lowlevel.current_trio_token(), kill_worker)
            with trio.fail_after(30), pytest.raises(Exception) as info:
                await trio.to_thread.run_sync(trainer.send_weights, "v2")
        assert "worker" in str(info.value).lower()
        with trio.fail_after(30):
            while llm.is_healthy:
                await trio.sleep(0.05)
        await llm.apply_fault_instruction("retry")
        assert llm.is_healthy
        assert await llm.get_weight_version() == "v1"
        assert await tokens(llm) == v1
        await llm.call_utility("sleep", 2)
        await llm.call_utility("wake_up")
        assert await tokens(llm) == v1


@pytest.fixture(autouse=True)
def _no_leaked_segments() -> Iterator[None]:
    before = set(os.listdir("/dev/shm"))
    yield
    mine = f"ringserve-{os.getpid()}-"  # other runs on the machine make their own
    leaked = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith(mine)}
    assert not leaked, leaked


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_engine_requantizes_in_place(quantization: str, tiny_llama_dir: Path) -> None:
    """A round of the checkpoint's own weights leaves a quantized engine's output unchanged
    (the panels are requantized in place), and a round of other weights changes it."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(str(tiny_llama_dir), quantization=quantization,
             weight_transfer_config={"backend": "shm"}, **ENGINE) as llm, \
            TrainerWeightTransferEngine({"backend": "shm"}, llm) as trainer:
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        checksum = llm.collective_rpc("get_weight_checksum")
        trainer.trainer_init(ModuleWeightSource(model))
        trainer.send_weights("same")
        assert llm.collective_rpc("get_weight_checksum") == checksum
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert again == before
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)
        trainer.send_weights("flipped")
        flipped = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert flipped != before
