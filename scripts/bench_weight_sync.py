#!/usr/bin/env python3
"""Weight sync from a trainer (issue 18, item 10): update time and GB/s per backend for a 135M-
and a 500M-parameter float32 model shape, against a memcpy of the same bytes in the same run,
and the whole pause -> update -> resume cycle.

In one process: an `LLM` on the shape (`--load-format dummy`, the default attention backend
and the captured decode step) started with `--weight-transfer-config {"backend": B}`, and a
trainer (`ringserve.weight_transfer.TrainerWeightTransferEngine`, the `LLM` as its sync
client) whose source holds the shape's HF-named float32 tensors (random values): in the
trainer's own memory (`--sources private`: every bucket is copied into the transport), or
moved into shared memory by `SharedWeights` (`shared`, shm only: the workers read them in
place). Every round is timed by phase through a wrapper of the client: start (the metadata
check, done once per distinct list; the standby model is built at the first round only),
update (every bucket: the trainer copies it into the transport unless shared, each worker
reads it in place and packs it into its standby model's panels, TP rank 0 also into the
snapshot), finish (the swap between steps, the decode capture again). "update GB/s" is the
bytes over the update phase alone, the transport; "round GB/s" over the whole round. The
baseline is a `copy_` of every source tensor into a preallocated one (the same bytes, one
read and one write), median of 5, at the same thread count. The cycle is `pause("keep")` ->
one round -> `resume()` with four requests in flight (each decoding: past its prefill, so the
pause ends the captured decode step running at the next layer, and the step queued behind it
is skipped: `ringserve.gpu.executor.step_hold`) that continue afterwards (their KV is
recomputed), target: under the memcpy time + 100 ms; a line per shape and backend says where
its time went (the pause, which returns once no step is in flight, the round's phases, the
resume).

    .venv/bin/python scripts/bench_weight_sync.py [--shapes 135m,500m] [--backends shm,gloo]
        [--rounds 3] [--threads 2] [--no-snapshot] [--bucket-bytes N]
        [--sources private,shared]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M (Llama, tied embeddings).
    "135m": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
             "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
             "tie_word_embeddings": True},
    # Qwen2.5-0.5B (Qwen2: q/k/v bias, tied embeddings).
    "500m": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
             "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 151936,
             "tie_word_embeddings": True},
}


def shape_dir(root: Path, shape: str) -> Path:
    """A model directory of `shape` (config + the tiny model's tokenizer; no weights)."""
    from profile_decode import shaped_model_dir

    return shaped_model_dir(root, f"shape-{shape}", "qwen2" if shape == "500m" else "llama",
                            {**SHAPES[shape], "dtype": "float32", "torch_dtype": "float32",
                             "max_position_embeddings": 2048,
                             # per-layer attention kinds of the tiny model's 2 layers
                             "layer_types": ["full_attention"] * SHAPES[shape][
                                 "num_hidden_layers"]})


def source_model(model_dir: Path) -> torch.nn.Module:
    """The shape as transformers builds it (HF names), random float32 values: the trainer's
    model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.uniform_(-0.02, 0.02, generator=gen)
    return model


def source_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by HF name (a tied weight once), as the trainer sends them."""
    return {name: param.detach() for name, param in model.named_parameters()}


def memcpy_seconds(tensors: dict[str, torch.Tensor]) -> float:
    """Median of 5 passes of copy_ of every tensor into a preallocated twin."""
    twins = {name: torch.empty_like(t) for name, t in tensors.items()}
    times = []
    for _ in range(6):
        start = time.perf_counter()
        for name, t in tensors.items():
            twins[name].copy_(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


class TimedClient:
    """The LLM as the trainer's sync client, timing each phase of a round."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.phases: dict[str, float] = {}
        self.calls: dict[str, int] = {}  # per phase, this round

    def _timed(self, phase: str, call: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - start
            self.calls[phase] = self.calls.get(phase, 0) + 1

    def get_world_size(self, include_dp: bool = True) -> int:
        return int(self.llm.get_world_size(include_dp))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> Any:
        return self._timed("init", self.llm.init_weight_transfer_engine, init_info)

    def start_weight_update(self, metadata: dict[str, Any] | None = None) -> Any:
        return self._timed("start", self.llm.start_weight_update, metadata)

    def update_weights(self, update_info: dict[str, Any]) -> Any:
        return self._timed("update", self.llm.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> Any:
        return self._timed("finish", self.llm.finish_weight_update, weight_version)


def span(values: list[float], scale: float = 1.0, fmt: str = ".1f") -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"


def bench(shape: str, backend: str, ns: argparse.Namespace, root: Path,
          model: torch.nn.Module, copy_s: float, shared: bool) -> dict[str, Any]:
    from ringserve import LLM, SamplingParams
    from ringserve.weight_transfer import (
        SharedWeights,
        StateDictSource,
        TrainerWeightTransferEngine,
    )

    tensors = source_tensors(model)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    config: dict[str, Any] = {"backend": backend, "snapshot": ns.snapshot}
    if ns.bucket_bytes:
        config["bucket_bytes"] = ns.bucket_bytes
    rounds: list[dict[str, float]] = []
    cycles: list[float] = []
    cycle_parts: list[dict[str, float]] = []  # where each cycle's time went
    with LLM(str(shape_dir(root, shape)), device="cpu", load_format="dummy",
             weight_transfer_config=config, kv_cache_memory=64 << 20, max_model_len=512,
             max_num_seqs=8) as llm:
        client = TimedClient(llm)
        with TrainerWeightTransferEngine(config, client) as trainer, \
                contextlib.ExitStack() as stack:
            source: Any = StateDictSource(tensors)
            if shared:  # the parameters move into shared memory: buckets are sent in place
                source = stack.enter_context(SharedWeights(model))
            trainer.trainer_init(source)
            trainer.send_weights("warm-up")
            for i in range(ns.rounds):
                client.phases, client.calls = {}, {}
                start = time.perf_counter()
                trainer.send_weights(f"r{i}")
                rounds.append({"round": time.perf_counter() - start, **client.phases})
            if shared:  # every bucket went in place
                sender: Any = trainer._transport
                assert sender.sent_in_place == client.calls["update"], sender.sent_in_place
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            engine = llm.llm_engine
            for i in range(ns.rounds):
                ids = {f"c{i}-{j}" for j in range(4)}
                for j, rid in enumerate(sorted(ids)):
                    engine.add_request(rid, {"prompt_token_ids": [5 + j] * 32}, params)
                decoding: set[str] = set()
                while decoding != ids:  # every request holds KV and decodes: no prefill
                    for output in engine.step():  # in flight when the pause comes
                        if len(output.outputs[0].token_ids) >= 2:
                            decoding.add(output.request_id)
                client.phases = {}
                start = time.perf_counter()
                llm.pause("keep")
                paused = time.perf_counter()
                trainer.send_weights(f"c{i}")
                sent = time.perf_counter()
                llm.resume()
                cycles.append(time.perf_counter() - start)
                cycle_parts.append({"pause": paused - start, "round": sent - paused,
                                    "resume": start + cycles[-1] - sent, **client.phases})
                while engine.has_unfinished_requests():
                    engine.step()
    update = [r["update"] for r in rounds]
    total = [r["round"] for r in rounds]
    return {
        "shape": shape, "backend": backend + (" (shared)" if shared else ""), "bytes": nbytes, "tensors": len(tensors),
        "round_s": total, "start_s": [r["start"] for r in rounds], "update_s": update,
        "finish_s": [r["finish"] for r in rounds], "cycle_s": cycles, "memcpy_s": copy_s,
        "cycle_parts_s": {k: [c[k] for c in cycle_parts]
                          for k in ("pause", "round", "start", "update", "finish", "resume")},
        "update_vs_memcpy": statistics.median(copy_s / u for u in update),
        "round_vs_memcpy": statistics.median(copy_s / t for t in total),
    }


def report(r: dict[str, Any]) -> list[str]:
    gb = r["bytes"] / 1e9
    target_cycle = r["memcpy_s"] + 0.1
    return [
        f"| {r['shape']} | {r['backend']} | {gb:.2f} | {span(r['round_s'], 1e3)} | "
        f"{span(r['start_s'], 1e3)} | {span(r['update_s'], 1e3)} | {span(r['finish_s'], 1e3)} | "
        f"{gb / statistics.median(r['update_s']):.2f} | {gb / statistics.median(r['round_s']):.2f} | "
        f"{gb / r['memcpy_s']:.2f} ({r['memcpy_s'] * 1e3:.1f} ms) | "
        f"{r['update_vs_memcpy'] * 100:.0f}% / {r['round_vs_memcpy'] * 100:.0f}% | "
        f"{span(r['cycle_s'], 1e3)} vs {target_cycle * 1e3:.0f} |"
    ]


def cycle_report(r: dict[str, Any]) -> str:
    """Where the cycle's time went (median ms): the pause (the steps in flight end or are
    skipped first), the round and its phases, the resume."""
    parts = r["cycle_parts_s"]
    return (f"{r['shape']} {r['backend']} cycle: " + ", ".join(
        f"{k} {statistics.median(v) * 1e3:.1f}" for k, v in parts.items()) + " ms (medians)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="135m,500m")
    p.add_argument("--backends", default="shm,gloo")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--snapshot", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's on-disk snapshot of each round (weight transfer config "
                   "`snapshot`; default on, as the engine's)")
    p.add_argument("--bucket-bytes", type=int, default=0,
                   help="the weight transfer config's bucket_bytes (default: the config's)")
    p.add_argument("--sources", default="private",
                   help="comma-separated: private (the trainer's tensors in its own memory, "
                   "copied into the transport's buckets) and/or shared (`SharedWeights`: the "
                   "parameters in shared memory, read in place; shm only)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    ns = p.parse_args()
    torch.set_num_threads(ns.threads)
    print(json.dumps({"python": platform.python_version(), "torch": torch.__version__,
                      "cpus": os.cpu_count(), "threads": ns.threads,
                      "load_average": os.getloadavg(), "command": shlex.join(sys.argv)}))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        root = Path(tmp)
        for shape in ns.shapes.split(","):
            model = source_model(shape_dir(root, shape))
            copy_s = memcpy_seconds(source_tensors(model))
            for backend in ns.backends.split(","):
                for source in ns.sources.split(","):
                    if source not in ("private", "shared"):
                        p.error(f"--sources: {source!r} is not private or shared")
                    if source == "shared" and backend != "shm":
                        continue  # only the shm transport reads a trainer's memory in place
                    result = bench(shape, backend, ns, root, model, copy_s, source == "shared")
                    results.append(result)
                    print("\n".join(report(result)), flush=True)
            del model
    print("\n| shape | backend | GB | round ms | start ms | update ms | finish ms | update GB/s "
          "| round GB/s | memcpy GB/s (ms) | update / round vs memcpy | cycle ms vs target |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for result in results:
        print("\n".join(report(result)))
    for result in results:
        print(cycle_report(result))
    print(f"load average at the end: {os.getloadavg()}")
    if ns.json is not None:
        ns.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
