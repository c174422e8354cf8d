#!/usr/bin/env python
"""Load time and peak memory: ringserve's loader vs transformers' `from_pretrained`.

Writes a ~500M-parameter Llama-shaped checkpoint in bfloat16, sharded with an index (random
values: the shapes are what matter; generated once into --dir), then loads it in fresh child
processes, alternating ringserve and transformers, --runs times each, after one untimed read of
every shard so both start from a warm page cache. Each child reports the load's wall time, its
resident memory just before loading (after the imports) and its peak (`ru_maxrss`); the figure
compared with the target is the peak minus that baseline, as a multiple of the checkpoint's
bytes. Rows: ringserve in bf16 (like for like with transformers, which keeps the stored
dtype) and ringserve with --dtype auto (float32 compute on a CPU without native bf16, so twice
the weights by design).

    .venv/bin/python scripts/bench_load.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8)
SHARD_BYTES = 300 << 20
TARGET_TIME_RATIO = 1.0
TARGET_RSS_RATIO = 1.2


def _tensors(shape: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def write_checkpoint(path: Path) -> int:
    """Write the bf16 sharded checkpoint (once); returns its tensor bytes."""
    import torch
    from safetensors.torch import save_file

    from ringserve.gpu.testing import tiny_model

    tensors = _tensors(SHAPE)
    total = sum(2 * _numel(s) for _, s in tensors)
    if (path / "model.safetensors.index.json").is_file():
        return total
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        if size and size + 2 * _numel(shape) > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += 2 * _numel(shape)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {n: (torch.ones(s) if len(s) == 1 else
                    torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in shard}
        save_file(data, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n, _ in shard})
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "dtype": "bfloat16", "bos_token_id": 0,
              "eos_token_id": 1, "hidden_act": "silu"}
    (tmp / "config.json").write_text(json.dumps(config))
    tok = tiny_model("llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok / name).is_file():
            shutil.copy(tok / name, tmp / name)
    tmp.rename(path)
    return total


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def child(kind: str, path: str) -> None:
    """Load once in this (fresh) process; print one JSON line."""
    import torch

    torch.set_num_threads(2)
    # Both sides import the same transformers modules before the clock starts (ringserve
    # reads config.json through AutoConfig, whose first call is part of the load either way).
    from transformers import AutoConfig, AutoModelForCausalLM

    del AutoConfig
    if kind != "transformers":
        from ringserve.config import ModelConfig
        from ringserve.gpu.attention.backend import TorchAttentionBackend
        from ringserve.gpu.layers.parallel import TPGroup
        from ringserve.gpu.weights.loader import load_model
    base = _rss_bytes()
    t0 = time.perf_counter()
    if kind == "transformers":
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    else:
        dtype = "bfloat16" if kind == "ringserve-bf16" else "auto"
        config = ModelConfig.from_model_dir(path, dtype=dtype)
        model = load_model(config, tp=TPGroup(), device=torch.device("cpu"),
                           backend=TorchAttentionBackend())
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(p.numel() for p in model.parameters())
    # transformers may leave weights in a mapping of the file, resident only once read; one
    # pass over every parameter shows what serving them costs (for ringserve: nothing more).
    with torch.no_grad():
        for p in model.parameters():
            p.sum(dtype=torch.float32)  # no float copy of the parameter
    touched = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "base": base, "peak": peak, "params": params,
                      "touched": touched, "dtype": str(next(model.parameters()).dtype)}))


KINDS = ("ringserve-bf16", "transformers", "ringserve-auto")


def run(path: Path, runs: int) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    for f in sorted(path.glob("*.safetensors")):  # warm the page cache for everyone
        with f.open("rb") as fh:
            while fh.read(64 << 20):
                pass
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    for _ in range(runs):
        for kind in KINDS:
            out = subprocess.run([sys.executable, __file__, "--child", kind, str(path)],
                                 capture_output=True, text=True, env=env, check=True)
            results[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


def report(results: dict[str, list[dict[str, Any]]], weight_bytes: int) -> list[str]:
    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    lines = ["| loader | load s, median (range) | peak RSS - baseline, GB | x checkpoint bytes "
             "| absolute peak RSS, GB | x checkpoint bytes after one read of every weight |",
             "|---|---|---|---|---|---|"]
    for kind, rs in results.items():
        extra = [(r["peak"] - r["base"]) / 1e9 for r in rs]
        touched = [(r["touched"] - r["base"]) / weight_bytes for r in rs]
        lines.append(f"| {kind} ({rs[0]['dtype']}) | {med([r['seconds'] for r in rs])} | "
                     f"{med(extra)} | {med([e * 1e9 / weight_bytes for e in extra])} | "
                     f"{med([r['peak'] / 1e9 for r in rs])} | {med(touched)} |")
    rs_t = statistics.median(r["seconds"] for r in results["ringserve-bf16"])
    hf_t = statistics.median(r["seconds"] for r in results["transformers"])
    rss = statistics.median((r["peak"] - r["base"]) / weight_bytes
                            for r in results["ringserve-bf16"])
    lines.append(f"\ncheckpoint: {weight_bytes / 1e9:.2f} GB bf16, "
                 f"{results['ringserve-bf16'][0]['params'] / 1e6:.0f}M parameters; ringserve / "
                 f"transformers load time {rs_t / hf_t:.2f} (target <= {TARGET_TIME_RATIO}: "
                 f"{'met' if rs_t <= hf_t * TARGET_TIME_RATIO else 'missed'}); ringserve bf16 "
                 f"peak RSS {rss:.2f}x the weights (target <= {TARGET_RSS_RATIO}: "
                 f"{'met' if rss <= TARGET_RSS_RATIO else 'missed'})")
    # (ringserve-auto is left out: its float32 linears are repacked into oneDNN buffers,
    # which are not parameters.)
    params = {k: results[k][0]["params"] for k in ("ringserve-bf16", "transformers")}
    if len(set(params.values())) != 1:
        lines.append(f"WARNING: parameter counts differ: {params}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoint is written "
                        "(default: .cache/bench_load under the project)")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    import torch
    import transformers

    path = Path(args.dir or Path(__file__).resolve().parent.parent / ".cache" / "bench_load")
    weight_bytes = write_checkpoint(path)
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"machine: {platform.machine()}, cpus={os.cpu_count()}, python "
          f"{platform.python_version()}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; {args.runs} runs per loader, alternating, warm page cache")
    for line in report(run(path, args.runs), weight_bytes):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
