#!/usr/bin/env python3
"""The renderer pool, threads against processes (issue 44, item 3): how the frontend should
preprocess images so the event loop never waits on one.

64 random 640x480 JPEG data URLs are decoded and preprocessed (the tiny Qwen2.5-VL's image
processor, ringserve's renderer path) inside a trio event loop whose 1 ms ticker records the
longest stall: inline on the loop, in 1, 2 and 4 worker threads (`trio.to_thread`), and in 2
worker processes (`concurrent.futures.ProcessPoolExecutor`; results come back pickled, which
is why processes could only ever be an internal pool). Prints images / s and the longest stall,
medians of `--runs` rounds with ranges.

    python scripts/bench_mm_renderer.py --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mm import LoopStall, jpeg_url
from cpu_bench import header_lines

_RENDERER: Any = None


def _renderer() -> Any:
    global _RENDERER
    if _RENDERER is None:
        from ringserve.engine.arg_utils import EngineArgs
        from ringserve.engine.frontend.multimodal.renderer import ImageRenderer
        from ringserve.gpu.multimodal.testing import tiny_vlm
        from ringserve.tokenizer import load_tokenizer

        config = EngineArgs(model=str(tiny_vlm("qwen2_5_vl")),
                            mm_processor_cache_gb=0).create_engine_config()
        assert config.multimodal_config is not None
        _RENDERER = ImageRenderer(config.model_config, config.multimodal_config,
                                  load_tokenizer(config))
        _RENDERER.warm_up()
    return _RENDERER


def render(url: str) -> int:
    """Preprocess one image (the cache is off); returns its rows."""
    return int(_renderer().load_processed(url).num_embeds)


def measure(mode: str, urls: list[str], pool: ProcessPoolExecutor | None) -> tuple[float, float]:
    import trio

    stalls: list[float] = []

    async def main() -> float:
        stall = LoopStall()
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stall.watch)
            await trio.sleep(0.005)
            start = time.perf_counter()
            if mode == "inline":
                for url in urls:
                    render(url)
                    await trio.lowlevel.checkpoint()
            elif mode.startswith("threads"):
                limiter = trio.CapacityLimiter(int(mode.split("-")[1]))
                async with trio.open_nursery() as inner:
                    for url in urls:
                        inner.start_soon(lambda u=url: trio.to_thread.run_sync(
                            render, u, limiter=limiter))
            else:
                assert pool is not None
                futures = [pool.submit(render, url) for url in urls]
                for future in futures:
                    while not future.done():
                        await trio.sleep(0.0005)
            elapsed = time.perf_counter() - start
            stall.stop()
        stalls.append(stall.longest)
        return elapsed

    elapsed = trio.run(main)
    return len(urls) / elapsed, stalls[0] * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--images", type=int, default=64)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    for line in header_lines(torch.get_num_threads()):
        print(line)
    urls = [jpeg_url(i) for i in range(args.images)]
    _renderer()
    with ProcessPoolExecutor(2) as pool:
        list(pool.map(render, urls[:4]))  # the workers load the processor first
        print("| pool | images / s | longest loop stall, ms |")
        print("|---|---|---|")
        for mode in ("inline", "threads-1", "threads-2", "threads-4", "processes-2"):
            rows = [measure(mode, urls, pool) for _ in range(args.runs)]
            rate, stall = [r[0] for r in rows], [r[1] for r in rows]
            print(f"| {mode} | {statistics.median(rate):.1f} ({min(rate):.1f}-{max(rate):.1f}) "
                  f"| {statistics.median(stall):.1f} ({min(stall):.1f}-{max(stall):.1f}) |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
