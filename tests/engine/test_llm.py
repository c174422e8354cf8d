"""ringserve.LLM end to end: greedy parity with transformers, preemption, n>1 seeds, chat,
bad input, start-up failures and process hygiene (the core runs in its own process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ringserve import SamplingParams
from ringserve.engine.errors import EngineStartupError
from ringserve.engine.frontend.llm import LLM

PROMPTS = ["Hello there", "naïve café — 你好 👋 and more",
           "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3, "x"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SMALL = {"device": "cpu", "kv_cache_memory": 16 << 20, "max_num_seqs": 8,
         "max_num_batched_tokens": 32}


def _hf_greedy(model_dir: Path, prompts: list[str], max_new: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    out = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=None)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def _token_ids(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "async_scheduling"),
                         [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", True)])
def test_greedy_matches_transformers(family: str, async_scheduling: bool,
                                     request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(f"tiny_{family}_dir")
    expected = _hf_greedy(model_dir, PROMPTS, 12)
    with LLM(str(model_dir), async_scheduling=async_scheduling, **SMALL) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _token_ids(outputs) == expected
    assert [o.prompt for o in outputs] == PROMPTS
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)


@pytest.mark.slow
def test_preemption_yields_solo_outputs(tiny_llama_dir: Path) -> None:
    prompts = [f"request {i}: " + "lorem ipsum " * (4 + i) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(str(tiny_llama_dir), device="cpu", num_gpu_blocks_override=12,
             max_num_seqs=6, max_num_batched_tokens=64) as llm:
        solo = [_token_ids(llm.generate(p, params, use_tqdm=False))[0] for p in prompts]
        together = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.llm_engine.call_utility("get_stats")
    assert _token_ids(together) == solo
    assert stats["kv_cache_usage"] == 0.0


@pytest.mark.slow
def test_n_with_seed_is_reproducible_and_chat_works(tiny_llama_dir: Path) -> None:
    params = SamplingParams(n=3, seed=1234, temperature=1.0, max_tokens=8, ignore_eos=True)
    with LLM(str(tiny_llama_dir), **SMALL) as llm:
        first = llm.generate("Once upon a time", params, use_tqdm=False)[0]
        second = llm.generate(["Once upon a time"], [params], use_tqdm=False)[0]
        chat = llm.chat([{"role": "user", "content": "hi"}],
                        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                        use_tqdm=True)
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate({"prompt_token_ids": [5] * 5000}, GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=r"SamplingParams\.logprobs"):
            llm.generate("x", SamplingParams(logprobs=50), use_tqdm=False)
        after = llm.generate("x", GREEDY, use_tqdm=False)  # the engine keeps serving
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert _token_ids([first]) == _token_ids([second])
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    assert chat[0].prompt is not None and chat[0].prompt.endswith("<|im_start|>assistant\n")
    assert len(after[0].outputs[0].token_ids) == 12


def test_startup_failure_reports_the_reason(tiny_llama_dir: Path) -> None:
    with pytest.raises(EngineStartupError, match="KV cache too small"):
        LLM(str(tiny_llama_dir), device="cpu", num_gpu_blocks_override=1)


_PARENT = """
import os, sys
from ringserve.engine.frontend.llm import LLM
llm = LLM(sys.argv[1], device="cpu", kv_cache_memory=16 << 20)
print(llm.llm_engine.engine_core.process.pid, flush=True)
import time; time.sleep(120)
"""


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


@pytest.mark.slow
def test_sigkilled_parent_leaves_no_engine_core(tiny_llama_dir: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tiny_llama_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        core_pid = int(parent.stdout.readline())
        assert _title(core_pid).startswith("ringserve::EngineCore_DP0")
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and Path(f"/proc/{core_pid}").exists():
            if _title(core_pid) == "":  # a zombie has no cmdline: it is gone
                break
            time.sleep(0.05)
        assert _title(core_pid) == "", "the engine core outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_mp_executor_tensor_parallel_matches_transformers(tp: int, tiny_qwen2_dir: Path) -> None:
    expected = _hf_greedy(tiny_qwen2_dir, PROMPTS, 12)
    with LLM(str(tiny_qwen2_dir), tensor_parallel_size=tp, distributed_executor_backend="mp",
             **SMALL) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _token_ids(outputs) == expected


@pytest.mark.slow
def test_sleep_wake_up_keeps_outputs(tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), **SMALL) as llm:
        before = _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        llm.sleep(2)
        llm.wake_up()
        after = _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        assert llm.reset_prefix_cache()
    assert before == after


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


@pytest.mark.slow
def test_idle_worker_death_ends_the_core_at_once(tiny_llama_dir: Path) -> None:
    from ringserve.engine.errors import EngineDeadError

    # Fault tolerance off: fail fast (with it on the core waits for an instruction instead,
    # tests/engine/test_fault_tolerance.py).
    llm = LLM(str(tiny_llama_dir), distributed_executor_backend="mp",
              enable_fault_tolerance=False, **SMALL)
    try:
        llm.generate("warm", GREEDY, use_tqdm=False)
        core = llm.llm_engine.engine_core.process  # type: ignore[attr-defined]
        workers = [p for p in _children(core.pid) if _title(p).startswith("ringserve::Worker_TP")]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        assert core.exited.wait(5.0), "the idle core did not notice its worker's death"
        assert core.proc.returncode == 1
        with pytest.raises(EngineDeadError, match=r"Worker_TP0.*killed by signal 9"):
            llm.generate("after", GREEDY, use_tqdm=False)
    finally:
        llm.close()
