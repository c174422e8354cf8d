#!/usr/bin/env python3
"""Decode ms per output token, SmolLM-135M shape: ringserve vs llama-server and transformers.

Issue 17, item 5; the memory-bandwidth bound is measured in the same run.

The model: a Llama of SmolLM-135M's shape (hidden 576, intermediate 1536, 30 layers, 9 heads,
3 KV heads, vocab 49152, tied embeddings, float32; profile_decode.py's SMOL_135M) with real
saved random weights (normal, std 0.02, seed 0; `save_pretrained` safetensors), so that every
engine reads the same numbers. Its tokenizer is StarCoder2's 49152-token byte-level BPE,
rebuilt as a tokenizer.json from the vocab-only GGUF that llama.cpp ships
(models/ggml-vocab-starcoder.gguf): transformers loads it, and llama.cpp's converter recognises
its pre-tokenizer ("starcoder") with no patching. Prompts are token ids, the same on every side.
Built once under .cache/bench_decode/, with the GGUF conversions (F32 by the vendored
convert_hf_to_gguf.py, then Q8_0 and Q4_1 by llama-quantize; the tokenizer comes from the
sdist below, so even `--only ringserve` fetches that once).

llama.cpp: the one vendored by the llama-cpp-python source distribution (`pip download
--no-binary :all:` into .cache/), built CPU-only (Release, GGML_NATIVE) into
.cache/llama.cpp-build/ when llama-server or llama-quantize is missing (`--build-only` stops
there; 47 minutes on 2 busy cores). The converter wants sentencepiece (pip-installed if
absent).

Rows, at each batch B (B concurrent streams, `--prompt-len` prompt tokens each, greedy,
end of sequence ignored; every side's output token counts are checked):
- ringserve (`LLM` in process; its engine core process gets OMP_NUM_THREADS = --threads) in
  float32, int8 and int4 (`quantization=`), bf16 (the same weights saved as a bf16
  checkpoint, `--dtype auto`: bf16 panels, float32 compute) and bf16-compute (that checkpoint
  with `dtype="bfloat16"`), each with the captured decode step (the default;
  `cuda_graph_sizes` = the benchmarked batches unless --cuda-graph-sizes says otherwise; the
  default ladder reaches 512, capped by max_num_seqs) and with `enforce_eager=True`. ms per token = (time
  of `generate` at max_tokens N - time at 1) / (N - 1), the prompts prefix-cached by a
  warm-up call.
- llama-server on the F32, Q8_0 and Q4_1 GGUFs (-t / -tb = --threads, -np B slots, -c = B x
  the per-slot context), B concurrent /completion requests with n_predict N: ms per token is the
  median over the streams of the server's `timings.predicted_per_token_ms`; the wall clock
  by ringserve's method (n_predict N against 1) is shown beside it. The server's process group
  is killed when each batch is done, whatever happens.
- transformers `generate` at batch 1 (min_new_tokens = max_new_tokens), same method as
  ringserve.
For each precision and batch the sides run in interleaved rounds (one run each, the order
rotating), so that a busy neighbour slows them alike; transformers joins the first
precision's batch 1. The ringserve engines live across the batches of one precision, a
llama-server for one batch (its slots are the batch).

The bound: the bytes one decode step reads (every weight once, the LM head included; packed
bytes for int8 / int4, the GGUF's own tensor bytes for llama.cpp; plus the KV cache at the
mean context, float32 for ringserve and f16 for llama.cpp) over the read bandwidth measured in
this run (a `.sum()` over 512 MB of float32 at --threads threads, median of 5; measured at the
start and at the end, the higher one used). "% of bound"
is bound / measured; "vs llama" is llama-server's ms (same precision: F32 ~ float32, Q8_0 ~
int8, Q4_1 ~ int4) over the row's ms, > 1 meaning faster than llama-server.

A real checkpoint instead of the random one (issue 48's targets): `--model-dir DIR` (its
float32 directory), `--bf16-dir DIR` (the same weights saved in bf16), `--gguf QUANT=FILE`
for each precision's llama-server weights (float32=F32, bf16=BF16, int4=Q4_1), and
`--llama-server BIN` (no build). With `--model-dir`, ringserve's int4 row serves the int4
GGUF file itself with no flags (its Q4_1 codes on int4 panels, as `ringserve serve FILE`
does), against llama-server on the same file.

    .venv/bin/python scripts/bench_decode.py [--threads 2] [--batches 1 8 32 64] [--tokens 32]
        [--runs 3] [--only ringserve|llama|hf ...] [--quant float32 bf16 bf16-compute int8 int4]
        [--cuda-graph-sizes ...] [--build-only] [--model-dir DIR --bf16-dir DIR
        --gguf float32=F32.gguf --gguf bf16=BF16.gguf --gguf int4=Q4_1.gguf
        --llama-server BIN]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
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
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from profile_decode import SMOL_135M, read_bandwidth, span

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
WORK = CACHE / "bench_decode"
BUILD = CACHE / "llama.cpp-build"
SEED = 0
INIT_STD = 0.02
# "bf16": the same weights saved as a bf16 checkpoint, served as `--dtype auto` serves it on
# CPU (bf16 panels, float32 compute); "bf16-compute": that checkpoint with --dtype bfloat16
# (torch's bf16 matmuls, bf16 activations and KV cache).
QUANTS = ("float32", "bf16", "bf16-compute", "int8", "int4")
BF16 = ("bf16", "bf16-compute")
GGUF_TYPE = {"float32": "F32", "bf16": "BF16", "bf16-compute": "BF16", "int8": "Q8_0",
             "int4": "Q4_1"}
TARGETS = ("llama-server", "llama-quantize")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               # No downloads at build time (no hub here) and no TLS: a localhost server.
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")
# Random prompt ids: past the StarCoder2 tokenizer's control tokens (0-37), inside its vocab.
PROMPT_IDS = (100, 49000)

def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- llama.cpp ---------------------------------------------------------------------------------


def llama_source() -> Path:
    """The llama.cpp vendored by the llama-cpp-python sdist, downloaded and unpacked under
    .cache/ when absent."""
    trees = sorted(CACHE.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"),
                   key=lambda p: p.stat().st_mtime)
    if trees:
        return trees[-1].parent
    CACHE.mkdir(parents=True, exist_ok=True)
    tarballs = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"), key=lambda p: p.stat().st_mtime)
    if not tarballs:
        log("downloading the llama-cpp-python sdist")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "llama-cpp-python",
                        "--no-binary", ":all:", "--no-deps", "-d", str(CACHE)], check=True)
        tarballs = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(tarballs[-1]) as tf:
        tf.extractall(CACHE, filter="data")
    return llama_source()


def _tool(name: str) -> str:
    """`name` from PATH or the venv, pip-installed into the venv when neither has it."""
    venv_bin = Path(sys.executable).parent
    found = shutil.which(name) or shutil.which(name, path=str(venv_bin))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", name], check=True)
        found = shutil.which(name, path=str(venv_bin))
    if not found:
        raise SystemExit(f"{name} is not on PATH and pip did not install it")
    return found


def _python_module(name: str) -> None:
    """pip-install `name` into the venv when it is not importable."""
    if importlib.util.find_spec(name) is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", name], check=True)


def _run_logged(cmd: list[str], log_name: str, env: dict[str, str] | None = None) -> None:
    """Run `cmd` with its output in WORK/`log_name`; on failure, exit naming the log."""
    path = WORK / log_name
    with path.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"{Path(cmd[1] if cmd[0] == sys.executable else cmd[0]).name} "
                         f"failed ({done.returncode}); see {path}")


def llama_binaries() -> dict[str, Path]:
    """llama-server and llama-quantize, built into .cache/llama.cpp-build/ when missing."""
    bins = {t: BUILD / "bin" / t for t in TARGETS}
    if all(p.is_file() for p in bins.values()):
        return bins
    src, cmake = llama_source(), _tool("cmake")
    generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}"]
    t0 = time.perf_counter()
    subprocess.run([cmake, "-S", str(src), "-B", str(BUILD), *generator, *CMAKE_FLAGS],
                   check=True, stdout=subprocess.DEVNULL)
    log(f"building {', '.join(TARGETS)} into {BUILD} (most of an hour on 2 cores)")
    subprocess.run([cmake, "--build", str(BUILD), "--target", *TARGETS,
                    "-j", str(os.cpu_count() or 1)], check=True)
    log(f"llama.cpp built in {time.perf_counter() - t0:.0f} s")
    return bins


# -- the model ---------------------------------------------------------------------------------


def write_tokenizer(out: Path, vocab_gguf: Path) -> None:
    """StarCoder2's tokenizer (vocab, merges, control tokens from llama.cpp's vocab-only GGUF)
    as a transformers tokenizer.json; its pre-tokenizer is StarCoder2's (digits split, then
    GPT-2's byte-level regex)."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fields = gguf.GGUFReader(vocab_gguf).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    control = int(gguf.TokenType.CONTROL)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types, strict=True) if kind == control])
    eos = tokens[0]  # <|endoftext|>
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eos, eos_token=eos, unk_token=eos,
                            pad_token=eos, clean_up_tokenization_spaces=False,
                            model_max_length=SMOL_135M["max_position_embeddings"],
                            ).save_pretrained(str(out))


def model_dir() -> Path:
    """The SmolLM-135M-shaped model directory with random weights (built once)."""
    out = WORK / "smol-135m-random"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    log(f"writing the model directory {out}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_tokenizer(tmp, llama_source() / "models" / "ggml-vocab-starcoder.gguf")
    shape = {k: v for k, v in SMOL_135M.items() if k != "torch_dtype"}
    config = LlamaConfig(**shape, rms_norm_eps=1e-5, hidden_act="silu",
                         initializer_range=INIT_STD, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(str(tmp))
    GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0).save_pretrained(str(tmp))
    tmp.rename(out)
    return out


def bf16_model_dir() -> Path:
    """`model_dir()`'s model saved in bf16 (config.json says bfloat16), built once."""
    out = WORK / "smol-135m-random-bf16"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import LlamaForCausalLM

    source = model_dir()
    log(f"writing the bf16 model directory {out}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    model = LlamaForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(str(tmp))
    tmp.rename(out)
    return out


def gguf_models(model: Path, quants: list[str], threads: int) -> dict[str, Path]:
    """The model as GGUF per ringserve precision (F32 converted, then quantized), built once."""
    src, out = llama_source(), WORK / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    paths = {q: out / f"smol-135m-random-{GGUF_TYPE[q]}.gguf" for q in quants}
    f32 = out / "smol-135m-random-F32.gguf"
    if not f32.is_file():
        log(f"converting {model.name} to {f32.name}")
        _python_module("sentencepiece")  # the converter imports it for any Llama tokenizer
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        _run_logged([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model),
                     "--outtype", "f32", "--outfile", str(f32) + ".tmp"], "convert.log", env)
        os.replace(str(f32) + ".tmp", f32)
    quantize = str(llama_binaries()["llama-quantize"])
    for q, path in paths.items():
        if not path.is_file():
            log(f"quantizing to {path.name}")
            _run_logged([quantize, str(f32), str(path) + ".tmp", GGUF_TYPE[q], str(threads)],
                        "quantize.log")
            os.replace(str(path) + ".tmp", path)
    return paths


def prompts(batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of `length` random token ids; the same first ones at every batch."""
    rng = random.Random(SEED)
    return [[rng.randrange(*PROMPT_IDS) for _ in range(length)] for _ in range(batch)]


# -- bytes per step ----------------------------------------------------------------------------


def kv_bytes(batch: int, context: float, itemsize: int) -> float:
    """The K and V one step reads: every stream's `context` positions in every layer."""
    s = SMOL_135M
    return float(batch * context * s["num_hidden_layers"] * 2 * s["num_key_value_heads"]
            * s["head_dim"] * itemsize)


def ringserve_weight_bytes(quant: str, batch: int) -> int:
    """Every linear once (packed bytes when quantized), the norms, the LM head (the tied
    embedding matrix; quantized as the linears are under int8 / int4) and the batch's
    embedding rows."""
    import torch

    from ringserve.gpu.layers.quant import nbytes, quantize

    s = SMOL_135M
    h, d, inter = s["hidden_size"], s["head_dim"], s["intermediate_size"]
    shapes = [((s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * d, h),
              (h, s["num_attention_heads"] * d), (2 * inter, h), (h, inter)]
    gen = torch.Generator().manual_seed(SEED)
    if quant == "float32":
        linears = sum(4 * n * k for n, k in shapes)
    elif quant in BF16:
        linears = sum(2 * n * k for n, k in shapes)
    else:
        linears = sum(nbytes(quantize(torch.randn(n, k, generator=gen) * INIT_STD, quant))
                      for n, k in shapes)
    norms = (2 * s["num_hidden_layers"] + 1) * h * 4
    head = s["vocab_size"] * h * (2 if quant in BF16 else 4)
    if quant not in ("float32", *BF16):
        head = nbytes(quantize(torch.randn(s["vocab_size"], h, generator=gen) * INIT_STD, quant))
    return int(s["num_hidden_layers"] * linears + norms + head + batch * h * 4)


def gguf_weight_bytes(path: Path) -> int:
    """The GGUF's tensor bytes: every weight once (the tied token embedding is the LM head)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


# -- the sides: each warms up, then hands back one measured run --------------------------------

Sample = dict[str, float]  # figure name -> value; MS is the one the table reports
MS, WALL = "ms/token", "wall ms/token"
Key = tuple[Any, ...]  # ("ringserve", quant, eager), ("llama", quant) or ("hf",)


def ringserve_engine(model: Path, quant: str, eager: bool, args: argparse.Namespace) -> Any:
    """An `LLM` on the CPU for one precision, captured or eager."""
    from ringserve import LLM

    kw: dict[str, Any] = {"device": "cpu", "max_num_seqs": max(args.batches),
                          "max_model_len": args.context, "disable_log_stats": True,
                          "enforce_eager": eager, "cuda_graph_sizes": args.cuda_graph_sizes}
    if quant in BF16:
        model = args.bf16_dir or bf16_model_dir()
        if quant == "bf16-compute":
            kw["dtype"] = "bfloat16"
    elif quant == "int4" and args.model_dir is not None and "int4" in args.gguf:
        model = args.gguf["int4"]  # the file itself, served from its codes with no flags
    elif quant != "float32":
        kw["quantization"] = quant
    return LLM(str(model), **kw)


def ringserve_side(llm: Any, batch: int, args: argparse.Namespace) -> Callable[[], Sample]:
    """One run: ms per decode token through `LLM.generate` (max_tokens N against 1), and the
    seconds of both calls."""
    from ringserve.sampling_params import SamplingParams

    batch_prompts: list[Any] = [{"prompt_token_ids": p} for p in prompts(batch, args.prompt_len)]

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        outputs = llm.generate(batch_prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        counts = {len(o.outputs[0].token_ids) for o in outputs}
        if len(outputs) != batch or counts != {n}:
            raise RuntimeError(f"ringserve: expected {n} tokens x {batch}, got counts {counts} "
                               f"x {len(outputs)}")
        return elapsed

    run(min(args.tokens, 8))  # warm-up: caches the prompts, builds the captured step

    def once() -> Sample:
        long, short = run(args.tokens), run(1)
        return {MS: 1e3 * (long - short) / (args.tokens - 1), "s at N": long, "s at 1": short}
    return once


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def llama_server(binary: Path, gguf_path: Path, threads: int, slots: int, context: int
                 ) -> Iterator[str]:
    """A llama-server on a free localhost port (its URL); its process group is killed on exit."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf_path), "-t", str(threads), "-tb", str(threads),
           "-np", str(slots), "-c", str(slots * context), "--host", "127.0.0.1",
           "--port", str(port), "--no-warmup"]
    log_path = WORK / "llama-server.log"
    with log_path.open("w") as server_log:
        proc = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited {proc.returncode}; see {log_path}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError):
                    pass  # loading the model (503) or not listening yet
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server not ready in 120 s; see {log_path}")
                time.sleep(0.2)
            yield url
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue


def completions(url: str, batch_prompts: list[list[int]], n: int
                ) -> tuple[float, list[dict[str, Any]]]:
    """Send every prompt at once to /completion; (wall seconds, the responses)."""
    def one(prompt: list[int]) -> dict[str, Any]:
        body = json.dumps({"prompt": prompt, "n_predict": n, "ignore_eos": True,
                           "temperature": 0.0, "cache_prompt": True}).encode()
        req = urllib.request.Request(url + "/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            result: dict[str, Any] = json.loads(r.read())
        if result.get("tokens_predicted") != n:
            raise RuntimeError(f"llama-server: expected {n} tokens, got "
                               f"{result.get('tokens_predicted')}")
        return result

    with ThreadPoolExecutor(max_workers=len(batch_prompts)) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(one, batch_prompts))
        return time.perf_counter() - t0, results


def llama_side(url: str, batch: int, args: argparse.Namespace) -> Callable[[], Sample]:
    """One run: the server's ms per token (median over the streams), the wall clock's ms per
    token (n_predict N against 1) and the seconds of both rounds of requests."""
    batch_prompts = prompts(batch, args.prompt_len)
    completions(url, batch_prompts, min(args.tokens, 8))  # warm-up; caches the prompts

    def once() -> Sample:
        long, results = completions(url, batch_prompts, args.tokens)
        short, _ = completions(url, batch_prompts, 1)
        return {MS: statistics.median(r["timings"]["predicted_per_token_ms"] for r in results),
                WALL: 1e3 * (long - short) / (args.tokens - 1), "s at N": long, "s at 1": short}
    return once


def hf_side(model: Path, args: argparse.Namespace) -> Callable[[], Sample]:
    """One run: ms per decode token of transformers' greedy `generate` at batch 1, and the
    seconds of both calls."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    ids = torch.tensor(prompts(1, args.prompt_len))

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        elapsed = time.perf_counter() - t0
        if out.shape[1] - ids.shape[1] != n:
            raise RuntimeError(f"transformers: expected {n} tokens, got "
                               f"{out.shape[1] - ids.shape[1]}")
        return elapsed

    run(min(args.tokens, 8))

    def once() -> Sample:
        long, short = run(args.tokens), run(1)
        return {MS: 1e3 * (long - short) / (args.tokens - 1), "s at N": long, "s at 1": short}
    return once


# -- running -----------------------------------------------------------------------------------


def label(key: Key) -> str:
    if key[0] == "ringserve":
        return f"ringserve {key[1]}{' eager' if key[2] else ''}"
    return f"llama-server {GGUF_TYPE[key[1]]}" if key[0] == "llama" else "transformers"


def run_group(sides: dict[Key, Callable[[], Sample]], batch: int, args: argparse.Namespace,
              results: dict[Key, Any]) -> None:
    """`args.runs` rounds of one run per side, the order rotating each round, so that a busy
    neighbour slows every side alike."""
    keys = list(sides)
    for r in range(args.runs):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            for name, value in sides[key]().items():
                results.setdefault(key, {}).setdefault(batch, {}).setdefault(name, []).append(
                    value)
    for key in keys:
        figures = ", ".join(f"{n} {span(v)}" for n, v in results[key][batch].items())
        log(f"  {label(key)} batch {batch}: {figures}")


def measure(quant: str, model: Path, binaries: dict[str, Path], ggufs: dict[str, Path],
            args: argparse.Namespace, results: dict[Key, Any]) -> None:
    """Every side of one precision, batch by batch, in interleaved rounds; transformers joins
    the first precision's batch 1."""
    with contextlib.ExitStack() as engines:
        llms = {eager: engines.enter_context(ringserve_engine(model, quant, eager, args))
                for eager in (False, True) if "ringserve" in args.only}
        for batch in args.batches:
            with contextlib.ExitStack() as stack:
                sides: dict[Key, Callable[[], Sample]] = {
                    ("ringserve", quant, eager): ringserve_side(llm, batch, args)
                    for eager, llm in llms.items()}
                if "llama" in args.only:
                    url = stack.enter_context(llama_server(
                        binaries["llama-server"], ggufs[quant], args.threads, batch,
                        args.context))
                    sides["llama", quant] = llama_side(url, batch, args)
                if "hf" in args.only and batch == 1 and quant == args.quant[0]:
                    sides["hf",] = hf_side(model, args)
                if sides:
                    run_group(sides, batch, args, results)


# -- reporting ---------------------------------------------------------------------------------


def row(name: str, batch: int, ms: list[float], step_bytes: float, bandwidth: float,
        llama_ms: float | None, wall: str = "-") -> str:
    med = statistics.median(ms)
    bound = 1e3 * step_bytes / bandwidth
    vs = f"{llama_ms / med:.2f}" if llama_ms else "-"
    rate = batch * 1e3 / med
    return (f"| {name} | {batch} | {span(ms)} | {wall} | {rate:.{0 if rate >= 100 else 1}f} | "
            f"{step_bytes / 1e6:.0f} | {bound:.2f} | {100 * bound / med:.0f}% | {vs} |")


def report(results: dict[Key, Any], args: argparse.Namespace, bandwidth: float,
           gguf_bytes: dict[str, int]) -> list[str]:
    """The markdown table: one row per engine, precision and batch."""
    context = args.prompt_len + args.tokens / 2  # the mean over the measured steps
    hidden = SMOL_135M["hidden_size"]
    lines = ["| engine, precision | batch | ms/token, median (range) | llama-server wall-clock "
             "ms/token | tokens/s | MB read/step | bound ms | % of bound | vs llama |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for quant in args.quant:
        llama = results.get(("llama", quant), {})
        for batch in args.batches:
            llama_ms = statistics.median(llama[batch][MS]) if batch in llama else None
            kv_item = 2 if quant == "bf16-compute" else 4
            rs_bytes = ringserve_weight_bytes(quant, batch) + kv_bytes(batch, context, kv_item)
            for eager in (False, True):
                got = results.get(("ringserve", quant, eager), {}).get(batch)
                if got:
                    mode = ("eager" if eager else "captured" if batch <= max(
                        args.cuda_graph_sizes) else "eager: past --cuda-graph-sizes")
                    lines.append(row(f"ringserve {quant} ({mode})", batch, got[MS], rs_bytes,
                                     bandwidth, llama_ms))
            if batch in llama:
                ll_bytes = (gguf_bytes[quant] + batch * hidden * 4
                            + kv_bytes(batch, context, 2))  # f16 KV
                lines.append(row(f"llama-server {GGUF_TYPE[quant]}", batch, llama[batch][MS],
                                 ll_bytes, bandwidth, None, span(llama[batch][WALL])))
    if ("hf",) in results:
        lines.append(row("transformers float32", 1, results["hf",][1][MS],
                         ringserve_weight_bytes("float32", 1) + kv_bytes(1, context, 4),
                         bandwidth, None))
    return lines


def header(args: argparse.Namespace, bandwidth: float) -> list[str]:
    import torch
    import transformers

    cpu = "unknown"
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    return [
        f"command: {' '.join([Path(sys.executable).name, *sys.argv])}",
        f"machine: {platform.machine()} {cpu}, cpus={os.cpu_count()}, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; python {platform.python_version()}"
        f", torch {torch.__version__}, transformers {transformers.__version__}, llama.cpp "
        f"{args.llama_server or llama_source().parent.parent.name}; {args.threads} threads "
        f"everywhere",
        f"read bandwidth (.sum() over 512 MB float32, {args.threads} threads, median of 5): "
        f"{bandwidth / 1e9:.2f} GB/s",
        f"workload: {args.model_dir or f'SmolLM-135M shape, random weights (std {INIT_STD})'}"
        f"{' and ' + str(args.bf16_dir) if args.bf16_dir else ''}"
        f"{'; GGUFs ' + ', '.join(f'{q}={p}' for q, p in args.gguf.items()) if args.gguf else ''}"
        f"; batch B = B concurrent "
        f"streams of {args.prompt_len} prompt tokens (prefix-cached), greedy, ignore_eos; "
        f"ms/token over {args.tokens - 1} decode steps (max_tokens {args.tokens} against 1), "
        f"median of {args.runs} interleaved runs (range); ringserve captured sizes "
        f"{' '.join(map(str, args.cuda_graph_sizes))}",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="threads for every engine")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--tokens", type=int, default=32,
                        help="max_tokens of the long call (N - 1 decode steps are measured)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (median, range)")
    parser.add_argument("--only", action="append", choices=("ringserve", "llama", "hf"),
                        help="repeatable; default: all three")
    parser.add_argument("--quant", nargs="+", choices=QUANTS, default=list(QUANTS),
                        help="ringserve precisions (llama-server: F32, Q8_0, Q4_1)")
    parser.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None,
                        help="ringserve's captured decode batch sizes (default: the --batches; "
                        "the engine's own default ladder is 1 2 4 8 16 32)")
    parser.add_argument("--build-only", action="store_true",
                        help="build llama.cpp, the model directory and the GGUFs, then stop")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a real float32 checkpoint directory instead of the random model")
    parser.add_argument("--bf16-dir", type=Path, default=None,
                        help="the same weights saved in bf16 (the bf16 rows)")
    parser.add_argument("--gguf", action="append", default=[], metavar="QUANT=FILE",
                        help="llama-server's weights for a precision (repeatable)")
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="a llama-server binary (nothing is built)")
    args = parser.parse_args(argv)
    try:
        args.gguf = {q: Path(p) for q, _, p in (g.partition("=") for g in args.gguf)}
    except ValueError:
        parser.error("--gguf takes QUANT=FILE")
    if args.llama_server is not None and "llama" in (args.only or ["llama"]):
        missing = [q for q in args.quant if q not in args.gguf]
        if missing:
            parser.error(f"--llama-server needs --gguf for {', '.join(missing)}")
    if args.tokens < 2 or args.runs < 1 or args.threads < 1 or min(args.batches) < 1:
        parser.error("--tokens must be >= 2 and --runs, --threads, --batches >= 1")
    args.batches = sorted(set(args.batches))
    args.cuda_graph_sizes = sorted(set(args.cuda_graph_sizes or args.batches))
    args.only = args.only or ["ringserve", "llama", "hf"]
    args.context = args.prompt_len + args.tokens + 16  # per stream, with slack
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the finally blocks stop llama-server and the engines.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch; the engine's core too
    model = args.model_dir or model_dir()
    binaries: dict[str, Path] = {}
    ggufs: dict[str, Path] = {}
    if args.llama_server is not None:
        binaries = {"llama-server": args.llama_server}
        ggufs = dict(args.gguf)
    elif args.build_only or "llama" in args.only:
        binaries = llama_binaries()
        ggufs = gguf_models(model, list(args.quant), args.threads)
    if args.build_only:
        print(f"built: {', '.join(str(p) for p in binaries.values())}; {model}; "
              f"{', '.join(p.name for p in ggufs.values())}")
        return 0
    import torch

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    bandwidth = read_bandwidth()
    for line in header(args, bandwidth):
        print(line, flush=True)
    results: dict[Key, Any] = {}
    for quant in args.quant:
        measure(quant, model, binaries, ggufs, args, results)
    if "hf" in args.only and ("hf",) not in results:  # no batch 1 among --batches
        run_group({("hf",): hf_side(model, args)}, 1, args, results)
    gguf_bytes = {q: gguf_weight_bytes(p) for q, p in ggufs.items()}
    again = read_bandwidth()
    print(f"read bandwidth again at the end: {again / 1e9:.2f} GB/s (the bound uses the higher)")
    print()
    for line in report(results, args, max(bandwidth, again), gguf_bytes):
        print(line)
    load = os.getloadavg()
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in load)}; measured in "
          f"{time.perf_counter() - started:.0f} s")
    if load[1] > (os.cpu_count() or 1) + 0.5:  # this run's own threads count in it too
        # An engine's threads meet at a barrier every op: one of them descheduled by a busy
        # neighbour stalls the others, so a loaded machine slows the threaded sides most.
        print(f"WARNING: the 5-minute load average ({load[1]:.2f}) exceeds the "
              f"{os.cpu_count()} cpus: other work shared the cores, the figures are not clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
