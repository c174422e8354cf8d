#!/usr/bin/env python3
"""Images in (issue 44, item 6): chat requests with one 640x480 JPEG each, ringserve against
transformers in the same run.

For each tiny vision-language model (Qwen2.5-VL and Gemma 3 from
`ringserve.gpu.multimodal.testing`): `--requests` requests (default 64), each a chat turn
with its own random 640x480 JPEG as a data: URL and `--max-tokens` output tokens (EOS
ignored, counts checked), `--concurrency` at a time (default 16), through ringserve's
`AsyncLLM` (the HTTP server's engine client: URL decoding and preprocessing in the renderer's
threads, the event loop measured by a 1 ms ticker whose longest lateness is the stall), then
transformers' `generate` in batches of `--concurrency` (its own PIL image processor, timed
with the generation; the share of its time spent preprocessing is printed). Then the
repeated-image TTFT: a new image sent once, then again (the second finds the processed-image
cache, the encoder cache and the prefix cache), each alone, for `--ttft-pairs` new images
(medians per run).

Prints the machine header and one table row per model and side; medians of `--runs` rounds
with their ranges.

    python scripts/bench_mm.py --runs 3
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_bench import header_lines


def jpeg_url(seed: int) -> str:
    """A random 640x480 JPEG as a data: URL."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    # Smooth noise compresses like a photo more than white noise does.
    small = rng.integers(0, 255, (60, 80, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((640, 480), Image.BILINEAR)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


class LoopStall:
    """The trio event loop's longest lateness: `watch` (started in a nursery) sleeps 1 ms at
    a time until `stop()` and records how late each wake-up came."""

    def __init__(self) -> None:
        import trio

        self.longest = 0.0
        self._done = trio.Event()

    async def watch(self) -> None:
        import trio

        while not self._done.is_set():
            before = time.perf_counter()
            await trio.sleep(0.001)
            self.longest = max(self.longest, time.perf_counter() - before - 0.001)

    def stop(self) -> None:
        self._done.set()


def chat_prompt(tokenizer: Any) -> str:
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "Describe the picture."}]}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True))


def run_ringserve(path: Path, urls: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Throughput, the longest event-loop stall and the repeated-image TTFTs."""
    import trio

    from ringserve import SamplingParams
    from ringserve.engine.arg_utils import EngineArgs
    from ringserve.engine.frontend.async_llm import AsyncLLM

    engine_args = EngineArgs(model=str(path), max_model_len=2048, kv_cache_memory=512 << 20,
                             limit_mm_per_prompt={"image": 1}, disable_log_stats=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    result: dict[str, float] = {}

    async def one(llm: AsyncLLM, prompt: str, url: str) -> tuple[int, float]:
        start = time.perf_counter()
        first = None
        tokens = 0
        async for out in llm.generate({"prompt": prompt, "multi_modal_data": {"image": url}},
                                      params):
            if first is None:
                first = time.perf_counter() - start
            tokens = len(out.outputs[0].token_ids)
        return tokens, first or 0.0

    async def main() -> None:
        async with AsyncLLM.from_engine_args(engine_args) as llm:
            prompt = chat_prompt(llm.tokenizer)
            await one(llm, prompt, jpeg_url(10_000))  # warm-up
            stall = LoopStall()

            counts: list[int] = []
            limiter = trio.CapacityLimiter(args.concurrency)

            async def worker(url: str) -> None:
                async with limiter:
                    tokens, _ = await one(llm, prompt, url)
                    counts.append(tokens)

            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stall.watch)
                async with trio.open_nursery() as inner:
                    for url in urls:
                        inner.start_soon(worker, url)
                stall.stop()
            elapsed = time.perf_counter() - start
            if any(c != args.max_tokens for c in counts) or len(counts) != len(urls):
                raise SystemExit(f"ringserve: token counts {sorted(set(counts))}")
            result["tok_s"] = sum(counts) / elapsed
            result["stall_ms"] = stall.longest * 1000
            firsts, agains = [], []
            for k in range(args.ttft_pairs):  # each a new image, then the same again
                fresh = jpeg_url(20_000 + 100 * k + int(time.time()) % 100)
                firsts.append((await one(llm, prompt, fresh))[1])
                agains.append((await one(llm, prompt, fresh))[1])
            result["ttft_first_ms"] = statistics.median(firsts) * 1000
            result["ttft_again_ms"] = statistics.median(agains) * 1000

    trio.run(main)
    return result


def run_transformers(path: Path, urls: list[str],
                     args: argparse.Namespace) -> tuple[float, float]:
    """Output tokens / s of batched `generate`, preprocessing included, and the share of the
    time spent preprocessing."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from ringserve.checkpoint.model_dir import load_hf_config
    from ringserve.engine.frontend.multimodal.media import MediaPolicy, load_image
    from ringserve.engine.frontend.multimodal.processors import ImageProcessor
    from ringserve.gpu.multimodal.families import family_of

    hf_config = load_hf_config(path)
    family = family_of(hf_config["architectures"][0], hf_config)
    assert family is not None
    processor = ImageProcessor(family, hf_config, path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = chat_prompt(tokenizer)
    embed_id = family.embed_token_id(hf_config)
    tokens = 0
    preprocessing = 0.0
    start = time.perf_counter()
    for i in range(0, len(urls), args.concurrency):
        begin = time.perf_counter()
        batch = [processor.process(load_image(u, MediaPolicy()), str(j))
                 for j, u in enumerate(urls[i:i + args.concurrency])]
        preprocessing += time.perf_counter() - begin
        texts = [prompt.replace(family.placeholder, p.replacement) for p in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        kw: dict[str, Any] = {}
        pixels = torch.from_numpy(np.concatenate([p.data["pixel_values"] for p in batch]))
        kw["pixel_values"] = pixels
        if family.mrope:
            kw["image_grid_thw"] = torch.from_numpy(
                np.concatenate([p.data["image_grid_thw"] for p in batch]))
            kw["mm_token_type_ids"] = (enc["input_ids"] == embed_id).int()
        else:
            kw["token_type_ids"] = (enc["input_ids"] == embed_id).long()
        with torch.inference_mode():
            out = model.generate(**enc, **kw, max_new_tokens=args.max_tokens,
                                 min_new_tokens=args.max_tokens, do_sample=False)
        new = out[:, enc["input_ids"].shape[1]:]
        if new.shape[1] != args.max_tokens:
            raise SystemExit(f"transformers: {new.shape[1]} tokens per request")
        tokens += int(new.numel())
    elapsed = time.perf_counter() - start
    return tokens / elapsed, preprocessing / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--families", nargs="+", default=["qwen2_5_vl", "gemma3"])
    parser.add_argument("--ttft-pairs", type=int, default=5,
                        help="new images whose TTFT is taken, then again (median per run)")
    args = parser.parse_args()
    import torch

    from ringserve.gpu.multimodal.testing import tiny_vlm

    torch.set_num_threads(2)
    for line in header_lines(torch.get_num_threads()):
        print(line)
    urls = [jpeg_url(i) for i in range(args.requests)]
    print("| model | ringserve tok/s | transformers tok/s | ratio | transformers' time "
          "preprocessing | longest loop stall, ms | TTFT first / repeated image, ms | "
          "repeated / first |")
    print("|---|---|---|---|---|---|---|---|")
    for family in args.families:
        path = tiny_vlm(family)
        rows: list[dict[str, float]] = []
        for _ in range(args.runs):
            row = run_ringserve(path, urls, args)
            row["hf"], row["hf_pre"] = run_transformers(path, urls, args)
            rows.append(row)

        def med(key: str, rows: list[dict[str, float]] = rows) -> str:
            values = [r[key] for r in rows]
            return (f"{statistics.median(values):,.1f} ({min(values):,.1f}-"
                    f"{max(values):,.1f})")

        ratio = [r["tok_s"] / r["hf"] for r in rows]
        rep = [r["ttft_again_ms"] / r["ttft_first_ms"] for r in rows]
        pre = [r["hf_pre"] * 100 for r in rows]
        print(f"| {family} | {med('tok_s')} | {med('hf')} | {statistics.median(ratio):.2f}x "
              f"({min(ratio):.2f}-{max(ratio):.2f}) | {statistics.median(pre):.0f}% | "
              f"{med('stall_ms')} | "
              f"{med('ttft_first_ms')} / {med('ttft_again_ms')} | "
              f"{statistics.median(rep):.2f} ({min(rep):.2f}-{max(rep):.2f}) |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
