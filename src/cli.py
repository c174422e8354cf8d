"""The `ringserve` command: subcommands over the library, with one-line errors for mistakes.

`ringserve serve [MODEL]` runs the OpenAI-compatible HTTP server (`ringserve.http.server`);
`ringserve demo-model PATH` writes the demo model directory; `ringserve bench ipc`,
`ringserve bench throughput`, `ringserve bench frontend` and `ringserve bench serve` run the
benchmarks of docs/benchmarks.md. A user mistake (bad
flag, missing model directory, out-of-range value, port in use) prints one
`ringserve: error: ...` line and exits with status 2, never a traceback; a server whose engine
died exits with status 1 after one such line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from ringserve.errors import RingserveError

Handler = Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one `ringserve: error: ...` line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"ringserve: error: {message} (see: {self.prog} --help)\n")


def _serve(ns: argparse.Namespace) -> int:
    from ringserve.engine.arg_utils import EngineArgs
    from ringserve.engine.errors import EngineDeadError
    from ringserve.http import server
    from ringserve.http.cli_args import settings_from_args

    engine_config = EngineArgs.from_cli_args(ns).create_engine_config()
    settings = settings_from_args(ns, engine_config)
    try:
        server.serve(engine_config, settings)
    except EngineDeadError as exc:
        print(f"ringserve: error: the engine died: {exc}", file=sys.stderr)
        return 1
    return 0


def _demo_model(ns: argparse.Namespace) -> int:
    import dataclasses

    from ringserve.gpu.testing import PRESETS, build_model_dir

    path = Path(ns.path)
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path} exists and is not empty; pass a new or empty directory")
    spec = dataclasses.replace(PRESETS[ns.preset], seed=ns.seed)
    build_model_dir(path, spec)
    print(f"wrote {ns.preset} model ({spec.arch}, hidden {spec.hidden_size}, "
          f"{spec.num_hidden_layers} layers, vocab {spec.vocab_size}) to {path}")
    return 0


def _bench_ipc(ns: argparse.Namespace) -> int:
    from ringserve.shm import bench

    return bench.main(list(ns.passthrough))


def _bench_throughput(ns: argparse.Namespace) -> int:
    from ringserve.engine import bench_throughput

    return bench_throughput.main(list(ns.passthrough))


def _bench_frontend(ns: argparse.Namespace) -> int:
    from ringserve.engine import bench_frontend

    return bench_frontend.main(list(ns.passthrough))


def _bench_serve(ns: argparse.Namespace) -> int:
    from ringserve.http import bench_serve

    return bench_serve.main(list(ns.passthrough))


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand."""
    from ringserve import __version__
    from ringserve.engine.arg_utils import EngineArgs
    from ringserve.gpu.testing import PRESETS
    from ringserve.http.cli_args import add_serve_args

    parser = _Parser(
        prog="ringserve",
        description="LLM inference and serving engine (vLLM V1 design on trio and shm rings).",
    )
    parser.add_argument("--version", action="version", version=f"ringserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="Serve MODEL (a Hugging Face model directory; default: "
                           "the demo model) over HTTP/1.1 and HTTP/2 with OpenAI's API.")
    EngineArgs.add_cli_args(serve, positional_model=True)
    add_serve_args(serve)
    serve.set_defaults(handler=_serve)

    demo = sub.add_parser("demo-model", help="write a tiny random-weight model directory",
                          description="Write a complete Hugging Face model directory "
                          "(config, safetensors weights, tokenizer with chat template).")
    demo.add_argument("path", help="directory to create (must be new or empty)")
    demo.add_argument("--preset", choices=sorted(PRESETS), default="demo",
                      help="model family and size (default: demo, the Llama demo model)")
    demo.add_argument("--seed", type=int, default=0, help="weights and tokenizer seed")
    demo.set_defaults(handler=_demo_model)

    bench = sub.add_parser("bench", help="benchmarks (see docs/benchmarks.md)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    ipc = bench_sub.add_parser("ipc", help="shm rings vs zmq ipc and multiprocessing.Pipe",
                               add_help=False)
    ipc.set_defaults(handler=_bench_ipc, passthrough_ok=True)
    throughput = bench_sub.add_parser(
        "throughput", add_help=False,
        help="LLM.generate vs transformers on the fixed workload; null-model engine overhead")
    throughput.set_defaults(handler=_bench_throughput, passthrough_ok=True)
    frontend = bench_sub.add_parser(
        "frontend", add_help=False,
        help="detokenize + stop check + collector per token vs re-decoding each step")
    frontend.set_defaults(handler=_bench_frontend, passthrough_ok=True)
    serve_bench = bench_sub.add_parser(
        "serve", add_help=False,
        help="load-test an OpenAI-compatible server (vllm bench serve's flags and report)")
    serve_bench.set_defaults(handler=_bench_serve, passthrough_ok=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    parser = build_parser()
    # Benchmarks parse their own flags: pass what the top-level parser does not know.
    ns, rest = parser.parse_known_args(argv)
    if rest and not getattr(ns, "passthrough_ok", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    ns.passthrough = rest
    handler: Handler = ns.handler
    try:
        return handler(ns)
    except (ValueError, RingserveError, OSError) as exc:
        print(f"ringserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
