#!/usr/bin/env python3
"""Prefill tokens / s of one cold request at a time (issue 48, item 7): ringserve against
transformers' forward on the same weights in the same process, and against llama-server when
one is given.

The model: a GGUF file (default the real SmolLM2-135M-Instruct, Q4_1, the file bench_agents
uses) written once per dtype as a Hugging Face checkpoint directory under
.cache/bench_prefill/ (config, generation config and tokenizer from ringserve's GGUF
materializer; `model.safetensors` from ringserve's GGUF loader, i.e. the values ringserve
serves when it dequantizes the file; float32, and the same values rounded to bfloat16 for the
bf16 directory, its config.json saying bfloat16). ringserve and transformers read that
directory, so both compute on the same float weights; `--model-dir` names a checkpoint
directory instead (then converted to each dtype on load).

For each dtype (`--dtypes`) the sides are:
- ringserve: `LLM` in this process (its engine core process runs with OMP_NUM_THREADS =
  --threads), `dtype="auto"` on the dtype's directory (float32: float32 panels; bfloat16:
  bf16 panels around float32 compute), float weights (a safetensors directory: no quantization),
  prefix caching on as by default; one request of the prompt's token ids, `max_tokens=1`,
  `ignore_eos`: tokens / s = prompt length / wall clock of `generate`. Each request is checked
  to have generated exactly 1 token, to report the prompt length sent and 0 cached tokens.
  `max_num_batched_tokens` is the engine's default unless --max-num-batched-tokens sets it (or
  the longest prompt is longer, when it is raised to that): the header says which, and how
  many chunks each prompt is prefilled in.
- transformers: `AutoModelForCausalLM` (attn_implementation "sdpa", the dtype) on torch's
  --threads threads; one `forward` of [1, n] ids under inference_mode with `logits_to_keep=1`
  (the last position's logits only, as ringserve and `generate` compute at prefill).
- llama-server, when the environment variable LLAMA_SERVER names its binary and `--gguf`
  names the same weights as GGUF (`--gguf PATH` for every dtype, or `--gguf DTYPE=PATH` per
  dtype: F32 for float32 and BF16 for bfloat16 to compare like with like): one server per
  dtype (-t / -tb --threads, -np 1, -c the longest prompt plus slack, `--llama-args` added),
  one POST /completion per prompt with the token ids, `n_predict: 1`, `cache_prompt: false`:
  its own `timings.prompt_per_second` and tokens / s by wall clock, both reported; the
  ratio uses the wall clock, as ringserve's does.

Prompts are random token ids (ids 100 .. vocab - 1), fresh for every round and length (no
prefix-cache hit is possible, and ringserve's check proves none happened); within a round
every side gets the same prompt. Each side runs once at the shortest length first (warm-up,
not counted). Then `--rounds` rounds: each runs every side once per length, the sides' order
rotating with the round and the length, so that a busy neighbour slows them alike. Cells are
medians (range) over the rounds; ratios are the median (range) of the per-round ratios.

    .venv/bin/python scripts/bench_prefill.py [--dtypes float32,bfloat16]
        [--lengths 512,2048,4096,8000] [--rounds 3] [--threads 2] [--model-gguf FILE.gguf]
        [--model-dir DIR] [--max-num-batched-tokens N]
        [--only ringserve,transformers,llama-server] [--seed 0]
    LLAMA_SERVER=/path/to/llama-server .venv/bin/python scripts/bench_prefill.py \\
        --gguf float32=model-F32.gguf --gguf bfloat16=model-BF16.gguf
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpu_bench import header_lines, load_text, load_warning, median_range, rotated

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".cache" / "bench_prefill"
DEFAULT_GGUF = ROOT / ".cache" / "bench_agents" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16")
GGUF_TYPE = {"float32": "F32", "bfloat16": "BF16"}  # llama.cpp's like-for-like tensor type
SIDES = ("ringserve", "transformers", "llama-server")
FIRST_ID = 100  # random prompt ids start past the special tokens
TOK_S, SERVER_TOK_S = "tok/s", "server tok/s"

Sample = dict[str, float]


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- the checkpoint ----------------------------------------------------------------------------


def gguf_types(path: Path) -> str:
    """`Q4_1 x 210, F32 x 61, ...`: the tensor types of a GGUF file."""
    from ringserve.checkpoint.gguf_header import read_header

    counts = Counter(t.type_name for t in read_header(path).tensors)
    return ", ".join(f"{name} x {n}" for name, n in counts.most_common())


def checkpoint(gguf: Path, dtype: str) -> Path:
    """The Hugging Face directory of `gguf`'s weights in `dtype`, written once under
    .cache/bench_prefill/ (keyed by the file's path, size and mtime)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    target = WORK / f"{gguf.stem}-{key[:12]}-{dtype}"
    if (target / "model.safetensors").is_file():
        return target
    import torch
    from safetensors.torch import save_file

    from ringserve.checkpoint.gguf_file import iterate_gguf_weights, materialize

    log(f"writing {target} from {gguf} ({dtype})")
    WORK.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=WORK))
    try:
        built = staging / "model"
        materialize(gguf, built)
        config = json.loads((built / "config.json").read_text())
        config["dtype"] = config["torch_dtype"] = dtype
        (built / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        weights = {name: tensor.detach().to(getattr(torch, dtype)).contiguous().clone()
                   for name, tensor in iterate_gguf_weights(gguf, config)}
        save_file(weights, str(built / "model.safetensors"), metadata={"format": "pt"})
        if target.exists():  # a partial directory of an interrupted run
            shutil.rmtree(target)
        built.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


# -- the sides ---------------------------------------------------------------------------------


@dataclass
class Side:
    """One engine: `run(prompt ids)` times one cold request; `close()` frees it."""

    name: str
    run: Callable[[list[int]], Sample]
    close: Callable[[], None]
    notes: list[str] = field(default_factory=list)


def ringserve_side(model_dir: Path, dtype: str, args: argparse.Namespace) -> Side:
    from ringserve import LLM, SamplingParams
    from ringserve.engine.arg_utils import EngineArgs

    longest = max(args.lengths)
    # `--dtype auto`, what a user gets: the directory's config.json names the dtype (a bf16
    # checkpoint is then served from bf16 panels around float32 compute).
    kw: dict[str, Any] = {"device": "cpu", "dtype": "auto", "disable_log_stats": True,
                          "max_model_len": max(8192, longest + 1)}
    budget_note = "the engine's default"
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
        budget_note = "--max-num-batched-tokens"
    else:
        config = EngineArgs(model=str(model_dir), **kw).create_engine_config()
        if config.scheduler_config.max_num_batched_tokens < longest:
            kw["max_num_batched_tokens"] = longest  # the whole prompt in one step
            budget_note = "raised from the engine's default to the longest prompt"
    llm = LLM(str(model_dir), **kw)
    budget = llm.llm_engine.config.scheduler_config.max_num_batched_tokens
    model_config = llm.llm_engine.config.model_config
    chunks = ", ".join(f"{n:,}: {-(-n // budget)}" for n in args.lengths)
    weights = (f"{model_config.load_format}, quantization {model_config.quantization}, "
               f"weight format {model_config.weight_format or model_config.dtype}")
    notes = [f"ringserve: {model_dir.name} ({weights}), dtype {model_config.dtype}, "
             f"max_model_len {model_config.max_model_len}, max_num_batched_tokens {budget:,} "
             f"({budget_note}); prefill chunks per prompt: {chunks}; every request checked: 1 "
             "token generated, the prompt length as sent, 0 tokens from the prefix cache"]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run(ids: list[int]) -> Sample:
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        wall = time.perf_counter() - start
        check_ringserve(outputs, len(ids))
        return {TOK_S: len(ids) / wall}

    return Side("ringserve", run, llm.close, notes)


def check_ringserve(outputs: list[Any], n: int) -> None:
    """One output of exactly 1 token for a prompt of n tokens, none of them from the cache.

    Raises:
        RuntimeError: otherwise (the message says what came back).
    """
    if len(outputs) != 1:
        raise RuntimeError(f"ringserve: {len(outputs)} outputs for one prompt")
    out = outputs[0]
    got = (len(out.outputs[0].token_ids), len(out.prompt_token_ids), out.num_cached_tokens)
    if got != (1, n, 0):
        raise RuntimeError(f"ringserve: (generated tokens, prompt length, cached tokens) = "
                           f"{got}, expected (1, {n}, 0)")


def transformers_side(model_dir: Path, dtype: str) -> Side:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()

    def run(ids: list[int]) -> Sample:
        input_ids = torch.tensor([ids])
        start = time.perf_counter()
        with torch.inference_mode():
            out = model(input_ids=input_ids, logits_to_keep=1)
        wall = time.perf_counter() - start
        if out.logits.shape[:2] != (1, 1):
            raise RuntimeError(f"transformers: logits of shape {tuple(out.logits.shape)}")
        return {TOK_S: len(ids) / wall}

    def close() -> None:
        nonlocal model
        del model

    notes = [f"transformers: {model_dir.name}, {dtype}, attn_implementation sdpa, forward with "
             "logits_to_keep=1"]
    return Side("transformers", run, close, notes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def llama_server(binary: str, gguf: Path, dtype: str, args: argparse.Namespace
                 ) -> Iterator[Side]:
    """A llama-server on a free localhost port, as a Side; its process group is killed on
    exit."""
    port = free_port()
    context = max(8192, max(args.lengths) + 64)
    cmd = [binary, "-m", str(gguf.resolve()), "-t", str(args.threads), "-tb", str(args.threads),
           "-np", "1", "-c", str(context), "--host", "127.0.0.1", "--port", str(port),
           *shlex.split(args.llama_args)]
    WORK.mkdir(parents=True, exist_ok=True)
    log_path = WORK / "llama-server.log"
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as server_log:
        proc = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_ready(proc, url, log_path)

            def run(ids: list[int]) -> Sample:
                start = time.perf_counter()
                result = completion(url, ids)
                wall = time.perf_counter() - start
                return {TOK_S: len(ids) / wall,
                        SERVER_TOK_S: float(result["timings"]["prompt_per_second"])}

            notes = [f"llama-server: {shlex.join(cmd)} ({gguf.name}: {gguf_types(gguf)}); "
                     f"log {log_path}"]
            if not gguf_types(gguf).startswith(GGUF_TYPE[dtype]):
                notes.append(f"NOTE: llama-server's weights are mostly not {GGUF_TYPE[dtype]}: "
                             f"it computes at another precision than {dtype}")
            yield Side("llama-server", run, lambda: None, notes)
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue


def wait_ready(proc: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    """Until GET /health answers 200 (the model is loaded).

    Raises:
        RuntimeError: the server exited, or was not ready in 180 s.
    """
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited {proc.returncode}; see {log_path}")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError), \
                urllib.request.urlopen(url + "/health", timeout=5) as r:
            if r.status == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"llama-server not ready in 180 s; see {log_path}")
        time.sleep(0.2)


def completion(url: str, ids: list[int]) -> dict[str, Any]:
    """POST /completion of the token ids for 1 token, uncached; the response, checked by
    `check_llama`."""
    body = json.dumps({"prompt": ids, "n_predict": 1, "cache_prompt": False,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(url + "/completion", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        result: dict[str, Any] = json.loads(r.read())
    check_llama(result, len(ids))
    return result


def check_llama(result: dict[str, Any], n: int) -> None:
    """A /completion response of 1 token predicted after n prompt tokens (or n + 1: a BOS
    the server added).

    Raises:
        RuntimeError: otherwise (the message says what came back).
    """
    prompt_n = result.get("timings", {}).get("prompt_n")
    if result.get("tokens_predicted") != 1 or prompt_n not in (n, n + 1):
        raise RuntimeError(f"llama-server: tokens_predicted {result.get('tokens_predicted')}, "
                           f"timings.prompt_n {prompt_n}; expected 1 and {n}")


# -- running -----------------------------------------------------------------------------------

Results = dict[str, dict[int, list[Sample]]]  # side -> prompt length -> one sample per round


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def measure(sides: list[Side], vocab: int, args: argparse.Namespace, seed: int) -> Results:
    """The warm-up, then `args.rounds` interleaved rounds over the lengths."""
    rng = random.Random(seed)
    by_name = {side.name: side for side in sides}
    names = tuple(by_name)
    for side in sides:
        side.run(prompt(rng, min(args.lengths), vocab))
    results: Results = {name: {n: [] for n in args.lengths} for name in names}
    for r in range(args.rounds):
        for i, n in enumerate(args.lengths):
            ids = prompt(rng, n, vocab)
            for name in rotated(names, r + i):
                sample = by_name[name].run(ids)
                results[name][n].append(sample)
                log(f"round {r + 1}/{args.rounds}, {n:,} tokens, {name}: "
                    f"{sample[TOK_S]:,.0f} tok/s")
    return results


def ratio_cell(a: list[Sample], b: list[Sample], key: str = TOK_S) -> str:
    """`1.23x (1.10-1.31)`: the median (range) of the per-round ratios a / b."""
    ratios = [x[key] / y[key] for x, y in zip(a, b, strict=True)]
    med, _, rest = median_range(ratios, 2).partition(" ")
    return f"{med}x {rest}"


def table(results: Results, lengths: list[int]) -> list[str]:
    """The markdown table of one dtype."""
    def cell(name: str, n: int, key: str = TOK_S) -> str:
        return median_range([s[key] for s in results[name][n]], 0, thousands=True)

    cols = ["prompt tokens"]
    has = {name: name in results for name in SIDES}
    if has["ringserve"]:
        cols.append("ringserve tok/s")
    if has["transformers"]:
        cols.append("transformers tok/s")
    if has["ringserve"] and has["transformers"]:
        cols.append("ringserve / transformers")
    if has["llama-server"]:
        cols += ["llama-server tok/s (its timings)", "llama-server tok/s (wall)"]
        if has["ringserve"]:
            cols.append("ringserve / llama-server (wall)")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for n in lengths:
        row = [f"{n:,}"]
        if has["ringserve"]:
            row.append(cell("ringserve", n))
        if has["transformers"]:
            row.append(cell("transformers", n))
        if has["ringserve"] and has["transformers"]:
            row.append(ratio_cell(results["ringserve"][n], results["transformers"][n]))
        if has["llama-server"]:
            row += [cell("llama-server", n, SERVER_TOK_S), cell("llama-server", n)]
            if has["ringserve"]:
                row.append(ratio_cell(results["ringserve"][n], results["llama-server"][n]))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def run_dtype(dtype: str, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(notes, table lines) of one dtype."""
    model_dir = args.model_dir or checkpoint(args.model_gguf, dtype)
    server_gguf = args.server_gguf.get(dtype)
    with contextlib.ExitStack() as stack:
        sides: list[Side] = []
        if "ringserve" in args.only:
            sides.append(ringserve_side(model_dir, dtype, args))
            stack.callback(sides[-1].close)
        if "transformers" in args.only:
            sides.append(transformers_side(model_dir, dtype))
            stack.callback(sides[-1].close)
        if server_gguf is not None:
            sides.append(stack.enter_context(llama_server(args.llama_binary, server_gguf, dtype,
                                                          args)))
        results = measure(sides, vocab_size(model_dir), args, args.seed + DTYPES.index(dtype))
        notes = [note for side in sides for note in side.notes]
    return notes, table(results, args.lengths)


def parse_gguf_flags(values: list[str], dtypes: list[str]) -> dict[str, Path]:
    """`--gguf PATH` (every dtype) or `--gguf DTYPE=PATH` items -> {dtype: path}.

    Raises:
        ValueError: an unknown dtype, or a file that does not exist.
    """
    out: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if sep and name in DTYPES:
            targets = [name]
        else:
            targets, path = list(dtypes), value
        if not Path(path).is_file():
            raise ValueError(f"--gguf {value}: no such file")
        for dtype in targets:
            out[dtype] = Path(path)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    first_paragraph = (__doc__ or "").split("\n\n")[0]
    parser = argparse.ArgumentParser(description=" ".join(first_paragraph.split()))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--lengths", default="512,2048,4096,8000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2,
                        help="torch's threads here, OMP_NUM_THREADS of the engine core, "
                        "llama-server's -t / -tb")
    parser.add_argument("--model-gguf", type=Path, default=DEFAULT_GGUF,
                        help="the GGUF the checkpoint directories are written from")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a Hugging Face checkpoint directory instead of --model-gguf's")
    parser.add_argument("--gguf", action="append", default=[], metavar="[DTYPE=]PATH",
                        help="llama-server's weights (with LLAMA_SERVER set); repeatable")
    parser.add_argument("--llama-args", default="", help="extra llama-server arguments")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="ringserve's step budget (default: the engine's)")
    parser.add_argument("--only", default="ringserve,transformers,llama-server",
                        help="comma-separated sides to run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.only = set(args.only.split(","))
    try:
        args.lengths = [int(n) for n in args.lengths.split(",")]
        args.server_gguf = parse_gguf_flags(args.gguf, args.dtypes)
    except ValueError as exc:
        parser.error(str(exc))
    bad = [d for d in args.dtypes if d not in DTYPES] + sorted(args.only - set(SIDES))
    if bad or args.rounds < 1 or args.threads < 1 or min(args.lengths) < 1:
        parser.error(f"unknown dtypes / sides {bad}; --rounds, --threads, --lengths >= 1")
    args.llama_binary = os.environ.get("LLAMA_SERVER")
    if "llama-server" not in args.only or not args.llama_binary:
        args.server_gguf = {}
    if not (args.only & {"ringserve", "transformers"} or args.server_gguf):
        parser.error("nothing to run: llama-server alone needs LLAMA_SERVER and --gguf")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the finally blocks stop llama-server and the engines.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch; the engine core too
    import torch
    import transformers

    from profile_decode import read_bandwidth

    torch.set_num_threads(args.threads)
    lines = header_lines(args.threads, f"transformers {transformers.__version__}")
    lines.append(f"read bandwidth (.sum() over 512 MB float32, median of 5): "
                 f"{read_bandwidth() / 1e9:.1f} GB/s")
    source = args.model_dir or (f"{args.model_gguf} ({gguf_types(args.model_gguf)}), "
                                "dequantized by ringserve's GGUF loader into a checkpoint "
                                "directory per dtype")
    lines.append(f"model: {source}")
    if "llama-server" in args.only and not args.server_gguf:
        lines.append("llama-server: skipped (set LLAMA_SERVER to its binary and --gguf to the "
                     "same weights as GGUF)")
    for line in lines:
        print(line, flush=True)
    started = time.perf_counter()
    for dtype in args.dtypes:
        dtype_started = time.perf_counter()
        notes, rows = run_dtype(dtype, args)
        print(f"\n## {dtype}: prefill tokens / s, one cold request at a time, median (range) "
              f"of {args.rounds} interleaved rounds ({time.perf_counter() - dtype_started:.0f} s)")
        for note in notes:
            print(f"- {note}")
        print()
        for row in rows:
            print(row, flush=True)
    print(f"\nload average at the end: {load_text()}; measured in "
          f"{time.perf_counter() - started:.0f} s")
    warning = load_warning()
    if warning:
        print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
