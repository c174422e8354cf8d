"""The `ringserve` command: subcommands over the library, with one-line errors for mistakes.

`ringserve serve [MODEL]` runs the OpenAI-compatible HTTP server (`ringserve.http.server`);
`ringserve demo-model PATH` writes the demo model directory; `ringserve bench ipc`,
`ringserve bench throughput`, `ringserve bench frontend` and `ringserve bench serve` run the
benchmarks of docs/benchmarks.md. `serve` takes the command lines published for
`vllm serve` (`ringserve.vllm_flags`: vLLM's spellings, `--config FILE.yaml`, flags with no
effect here, flags refused because they would change outputs).

Exit statuses, each after one `ringserve: error: ...` line and never a traceback: 2 for a bad
flag or flag value (out of range, port in use, unreadable --config file); 1 for a model
directory or file problem (`ModelDirectoryError`, the line names the file) and for a server
whose engine died.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ringserve.errors import ModelDirectoryError, RingserveError

Handler = Callable[[argparse.Namespace], int]


logger = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one `ringserve: error: ...` line.

    Args:
        context: what the flags were read from, put before the message (a --config file).
    """

    def __init__(self, *args: Any, context: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.context = context

    def error(self, message: str) -> NoReturn:
        where = f"{self.context}: " if self.context else ""
        self.exit(2, f"ringserve: error: {where}{message} (see: {self.prog} --help)\n")


def _serve(ns: argparse.Namespace) -> int:
    from ringserve.engine.arg_utils import EngineArgs
    from ringserve.engine.errors import EngineDeadError
    from ringserve.http import server
    from ringserve.http.cli_args import (
        apply_server_log_level,
        check_serve_args,
        settings_from_args,
    )
    from ringserve.http.cluster_args import cluster_from_args
    from ringserve.vllm_flags import no_effect_lines

    engine_args = EngineArgs.from_cli_args(ns)
    engine_args.verify()  # flag mistakes before any model is read
    check_serve_args(ns)
    cluster = cluster_from_args(ns)
    if not cluster.headless:
        # A port in use is one line before any model is read (and before the dtype line):
        # the real bind follows, after the config is built.
        server.open_listener(ns.host, ns.port).close()
    notes = no_effect_lines(ns)
    # Before the config is built: it logs the dtype and weight format chosen, and why.
    server.configure_logging()
    for line in notes:
        logger.info(line)
    apply_server_log_level(ns.uvicorn_log_level)
    engine_config = engine_args.create_engine_config()
    settings = settings_from_args(ns, engine_config)
    try:
        if cluster.scaled_out(engine_config):
            from ringserve.http.scaleout import serve_scaled_out

            serve_scaled_out(engine_config, settings, cluster)
        else:
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
    from ringserve.bench import ipc as bench

    return bench.main(list(ns.passthrough))


def _bench_throughput(ns: argparse.Namespace) -> int:
    from ringserve.bench import throughput as bench_throughput

    return bench_throughput.main(list(ns.passthrough))


def _bench_frontend(ns: argparse.Namespace) -> int:
    from ringserve.bench import frontend as bench_frontend

    return bench_frontend.main(list(ns.passthrough))


def _bench_serve(ns: argparse.Namespace) -> int:
    from ringserve.bench import serve as bench_serve

    return bench_serve.main(list(ns.passthrough))


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand."""
    return _build_parsers()[0]


def _build_parsers(context: str = "") -> tuple[argparse.ArgumentParser,
                                                argparse.ArgumentParser]:
    """The top-level parser and its `serve` subparser (errors prefixed with `context`)."""
    from ringserve import __version__
    from ringserve.engine.arg_utils import EngineArgs
    from ringserve.gpu.testing import PRESETS
    from ringserve.http.cli_args import add_serve_args
    from ringserve.http.cluster_args import add_cluster_args
    from ringserve.vllm_flags import add_vllm_flags

    parser = _Parser(
        prog="ringserve", context=context,
        description="LLM inference and serving engine (vLLM V1 design on trio and shm rings).",
    )
    parser.add_argument("--version", action="version", version=f"ringserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server", context=context,
                           description="Serve MODEL (a Hugging Face model directory; default: "
                           "the demo model) over HTTP/1.1 and HTTP/2 with OpenAI's API. "
                           "Takes vllm serve's flags (see README, drop-in flags).")
    EngineArgs.add_cli_args(serve, positional_model=True)
    add_serve_args(serve)
    add_cluster_args(serve)
    add_vllm_flags(serve)
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
    return parser, serve


def _config_path(args: Sequence[str]) -> str | None:
    """The value of the last `--config` among `serve`'s flags, if any."""
    path = None
    for i, token in enumerate(args):
        if token == "--config" and i + 1 < len(args):
            path = args[i + 1]
        elif token.startswith("--config="):
            path = token.partition("=")[2]
    return path


def _apply_config_file(serve: argparse.ArgumentParser, path: str) -> None:
    """Make the flags of a `--config` YAML file the defaults of `serve` (the command line wins).

    The file's flags are parsed by a parser of their own, whose errors name the file; only
    the values they set become defaults.
    """
    from ringserve.vllm_flags import config_file_argv

    negatable = {"--" + flag[len("--no-"):] for flag in serve._option_string_actions
                 if flag.startswith("--no-")}
    try:
        tokens = config_file_argv(path, negatable)
    except ValueError as exc:
        serve.exit(2, f"ringserve: error: {exc}\n")
    file_parser = _build_parsers(context=f"--config {path}")[0]
    from_file, rest = file_parser.parse_known_args(["serve", *tokens])
    if rest:
        file_parser.error(f"unrecognized arguments: {' '.join(rest)}")
    defaults = vars(file_parser.parse_known_args(["serve"])[0])
    given = {key: value for key, value in vars(from_file).items()
             if key != "config" and (key not in defaults or defaults[key] != value)}
    serve.set_defaults(**given)


def exit_status(exc: BaseException) -> int:
    """1 for a model directory or file problem and for an engine that failed to start, 2 for
    a user mistake (a flag or setting that cannot work).

    An engine core's error reaches the frontend as an `EngineStartupError` whose message holds
    it in the wire form `Type: message` (`ringserve.engine.core.faults.describe`): a
    `ValueError` there is a setting that cannot work (a KV cache too small for one block, a
    tensor-parallel split the model does not divide into): 2; anything else (the loader's
    `ModelDirectoryError`, a crash, a core that exited or never answered): 1.
    """
    from ringserve.engine.errors import EngineStartupError

    if isinstance(exc, ModelDirectoryError):
        return 1
    if isinstance(exc, EngineStartupError):
        return 2 if f"{ValueError.__name__}: " in str(exc) and (
            f"{ModelDirectoryError.__name__}: " not in str(exc)) else 1
    return 2


def parse_command_line(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a command line as `main` does, without running it.

    `serve` flags may be spelled with underscores (as vLLM allows) and come from a
    `--config` YAML file (the command line wins). Benchmarks get what the top-level parser
    does not know in `passthrough`.

    Raises:
        SystemExit: status 2 after one `ringserve: error: ...` line (a bad flag or value).
    """
    from ringserve.vllm_flags import normalize_flag_spelling

    args = list(argv)
    parser, serve = _build_parsers()
    if args[:1] == ["serve"]:
        args = normalize_flag_spelling(args)  # vLLM takes --max_model_len too
        config = _config_path(args)
        if config is not None:
            _apply_config_file(serve, config)
    ns, rest = parser.parse_known_args(args)
    if rest and not getattr(ns, "passthrough_ok", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    ns.passthrough = rest
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    ns = parse_command_line(sys.argv[1:] if argv is None else argv)
    handler: Handler = ns.handler
    try:
        return handler(ns)
    except (ValueError, RingserveError, OSError) as exc:
        print(f"ringserve: error: {exc}", file=sys.stderr)
        return exit_status(exc)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
