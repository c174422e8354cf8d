"""Every environment variable ringserve reads, typed, in one place (prefixed RINGSERVE_; two
vLLM names, VLLM_API_KEY and VLLM_ALLOW_RUNTIME_LORA_UPDATING, are honoured so vLLM deployments keep working).

| variable | default | meaning |
| --- | --- | --- |
| RINGSERVE_HOME | ~/.cache/ringserve | cache root (tiny and demo models) |
| RINGSERVE_ENABLE_MULTIPROCESSING | 1 | `LLM`/`LLMEngine` run the engine core in its own process |
| RINGSERVE_ENGINE_READY_TIMEOUT_S | 600 | seconds a frontend waits for a core's start-up handshake |
| RINGSERVE_ATTENTION_BACKEND | auto | attention backend: auto, torch, cpu (C kernel), triton |
| RINGSERVE_CORE_RESTART_LIMIT | 3 | restarts of one engine core allowed within the window below |
| RINGSERVE_CORE_RESTART_WINDOW_S | 600 | the window of that limit, in seconds |
| RINGSERVE_OUTPUT_PROC_CHUNK_SIZE | 128 | outputs the async output handler processes between yields |
| RINGSERVE_EXECUTOR_RING_BYTES | 16777216 | data bytes of each mp-executor ring (a power of two) |
| RINGSERVE_RAY_PLACEMENT_STRATEGY | PACK | the ray executor's placement of TP workers: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD |
| RINGSERVE_RAY_TMPDIR | (a fresh temp dir) | Ray's temp dir when the ray executor starts Ray itself |
| RINGSERVE_API_KEY | (unset: open) | `ringserve serve`'s API key(s), comma-separated, when `--api-key` is not given |
| VLLM_API_KEY | (unset) | the same, as vLLM names it; RINGSERVE_API_KEY wins when both are set |
| RINGSERVE_CLUSTER_SECRET | (unset) | the shared secret that authenticates links between hosts |
| RINGSERVE_CLUSTER_SECRET_FILE | (unset) | a file holding it (`--cluster-secret-file` sets this for child processes) |
| RINGSERVE_ALLOW_RUNTIME_LORA_UPDATING | 0 | `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` are served |
| VLLM_ALLOW_RUNTIME_LORA_UPDATING | 0 | the same, as vLLM names it |
| RINGSERVE_NULL_STEP_MS | (unset) | benchmarks only: `ringserve serve` runs a null model taking this long per step |
"""

from __future__ import annotations

import os
from pathlib import Path


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}: got {raw!r}, allowed: 0/1, true/false, yes/no, on/off")


def _number(name: str, default: float, *, minimum: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}: got {raw!r}, allowed: a number >= {minimum}") from None
    if value < minimum:
        raise ValueError(f"{name}: got {raw!r}, allowed: a number >= {minimum}")
    return value


def ringserve_home() -> Path:
    """RINGSERVE_HOME, else ~/.cache/ringserve."""
    return Path(os.environ.get("RINGSERVE_HOME") or Path.home() / ".cache" / "ringserve")


def allow_runtime_lora_updating() -> bool:
    """RINGSERVE_ALLOW_RUNTIME_LORA_UPDATING or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (off)."""
    return (_bool("RINGSERVE_ALLOW_RUNTIME_LORA_UPDATING", False)
            or _bool("VLLM_ALLOW_RUNTIME_LORA_UPDATING", False))


def enable_multiprocessing() -> bool:
    """RINGSERVE_ENABLE_MULTIPROCESSING (default on)."""
    return _bool("RINGSERVE_ENABLE_MULTIPROCESSING", True)


def engine_ready_timeout_s() -> float:
    """RINGSERVE_ENGINE_READY_TIMEOUT_S (default 600)."""
    return _number("RINGSERVE_ENGINE_READY_TIMEOUT_S", 600.0, minimum=1.0)


def attention_backend() -> str:
    """RINGSERVE_ATTENTION_BACKEND (default "auto"), as vLLM's VLLM_ATTENTION_BACKEND.

    "auto": Triton on CUDA; on CPU the C decode kernel when it builds, else the torch
    reference. "torch", "cpu" or "triton" force one.

    Raises:
        ValueError: another value.
    """
    value = os.environ.get("RINGSERVE_ATTENTION_BACKEND") or "auto"
    if value not in ("auto", "torch", "cpu", "triton"):
        raise ValueError(f"RINGSERVE_ATTENTION_BACKEND: got {value!r}, "
                         "allowed: auto, torch, cpu, triton")
    return value


def core_restart_limit() -> int:
    """RINGSERVE_CORE_RESTART_LIMIT (default 3): restarts of one core within the window.

    With fault tolerance on, a core process that dies is restarted; one that has already been
    restarted this many times within `core_restart_window_s()` is crash-looping, and its next
    death ends the engine (the server exits 1, for its supervisor to act on). 0: never restart.
    """
    return int(_number("RINGSERVE_CORE_RESTART_LIMIT", 3, minimum=0))


def core_restart_window_s() -> float:
    """RINGSERVE_CORE_RESTART_WINDOW_S (default 600): the window of the core restart limit."""
    return _number("RINGSERVE_CORE_RESTART_WINDOW_S", 600.0, minimum=1.0)


def output_proc_chunk_size() -> int:
    """RINGSERVE_OUTPUT_PROC_CHUNK_SIZE (default 128)."""
    return int(_number("RINGSERVE_OUTPUT_PROC_CHUNK_SIZE", 128, minimum=1))


def executor_ring_bytes() -> int:
    """RINGSERVE_EXECUTOR_RING_BYTES (default 16 MiB): data bytes of each executor ring.

    The mp executor's broadcast ring and per-worker response rings each get this many bytes
    (a power of two); the largest SchedulerOutput or ModelRunnerOutput is half of it. Pages
    are only touched as frames pass, so a large value costs little.
    """
    value = int(_number("RINGSERVE_EXECUTOR_RING_BYTES", 1 << 24, minimum=4096))
    if value & (value - 1):
        raise ValueError(f"RINGSERVE_EXECUTOR_RING_BYTES: got {value}, allowed: a power of two")
    return value


def ray_tmpdir() -> Path | None:
    """RINGSERVE_RAY_TMPDIR: Ray's temp dir (sessions, sockets, logs) for a local Ray it starts.

    Unset: the ray executor creates a fresh directory under the system temp dir and removes it
    after Ray has stopped. Set: Ray uses this directory (created if missing) and its session
    logs stay there. Unix socket paths inside it must fit in 107 bytes, so keep it short.
    """
    raw = os.environ.get("RINGSERVE_RAY_TMPDIR")
    return Path(raw) if raw else None


def api_key_variable() -> str | None:
    """The variable `api_key` reads: RINGSERVE_API_KEY if it is set and not empty, else
    VLLM_API_KEY if that is; None when neither is."""
    for name in ("RINGSERVE_API_KEY", "VLLM_API_KEY"):
        if os.environ.get(name):
            return name
    return None


def api_key() -> str | None:
    """RINGSERVE_API_KEY, else VLLM_API_KEY: the key (or comma-separated keys) the `/v1`
    routes require when `--api-key` is not given.

    Both unset or empty: the server is open (as vLLM with no `--api-key`).
    """
    name = api_key_variable()
    return None if name is None else os.environ[name]


def cluster_secret() -> bytes | None:
    """RINGSERVE_CLUSTER_SECRET: the shared secret of a multi-host deployment, surrounding
    whitespace stripped (None: unset; set but empty is b"", which the checks refuse)."""
    raw = os.environ.get("RINGSERVE_CLUSTER_SECRET")
    return None if raw is None else os.fsencode(raw).strip()


def ray_placement_strategy() -> str:
    """RINGSERVE_RAY_PLACEMENT_STRATEGY, raw ("" when unset; `ray_placement` checks it)."""
    return os.environ.get("RINGSERVE_RAY_PLACEMENT_STRATEGY", "")


def cluster_secret_file() -> str | None:
    """RINGSERVE_CLUSTER_SECRET_FILE: a file holding the shared secret (None: unset).

    `--cluster-secret-file` sets it for the processes `ringserve serve` starts.
    """
    return os.environ.get("RINGSERVE_CLUSTER_SECRET_FILE") or None


def null_step_ms() -> float | None:
    """RINGSERVE_NULL_STEP_MS: benchmarks only. Set, `ringserve serve`'s engine cores run the
    null model (no weights; made-up tokens) and each step takes this many milliseconds, so a
    frontend-bound workload can be measured (`scripts/bench_scaleout.py`)."""
    raw = os.environ.get("RINGSERVE_NULL_STEP_MS")
    if raw is None or raw == "":
        return None
    return _number("RINGSERVE_NULL_STEP_MS", 0.0, minimum=0.0)
