"""Model ids (`Qwen/Qwen2.5-0.5B-Instruct`) resolved to a local directory, as vLLM does.

`ModelConfig.from_model_dir` calls `resolve_model` first: a path that exists is used as it is;
anything else is taken for a Hugging Face hub id and looked up in the local hub cache
(`--download-dir`, else `$HF_HOME/hub`), and downloaded only when the cache lacks it, the hub
is reachable and `HF_HUB_OFFLINE` is unset. Only the files serving needs are fetched (configs,
safetensors or GGUF weights, tokenizer files, chat templates), never pickled `.bin` weights.
A model found nowhere fails with one line saying where it looked.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ringserve.errors import ModelDirectoryError

# What a serving engine needs from a repository; the pickled formats are left out on purpose.
ALLOW_PATTERNS = [
    "*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*", "*.tiktoken",
]

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def hub_offline() -> bool:
    """Whether `HF_HUB_OFFLINE` forbids downloads (read now, not at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir(download_dir: str | None) -> Path:
    """Where hub snapshots are looked up: `download_dir`, else the Hugging Face cache."""
    if download_dir is not None:
        return Path(download_dir)
    from huggingface_hub import constants

    return Path(os.environ.get("HF_HUB_CACHE") or Path(constants.HF_HOME) / "hub")


def resolve_model(model: str, *, revision: str | None = None,
                  download_dir: str | None = None) -> Path:
    """The local path of `model`: itself when it exists, else its hub snapshot.

    Args:
        model: a local directory or GGUF file, or a hub id ("org/name").
        revision: the branch, tag or commit of a hub id (default: main).
        download_dir: the hub cache to look in and download into.

    Raises:
        ModelDirectoryError: not a local path and not found in the cache (nor downloadable).
    """
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model.startswith((".", "/", "~")) or not _REPO_ID.fullmatch(model):
        raise ModelDirectoryError(f"model {path} does not exist (a model directory, a GGUF "
                                  "file or a hub id such as Qwen/Qwen2.5-0.5B-Instruct)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir(download_dir)
    try:
        return Path(snapshot_download(model, revision=revision, cache_dir=str(cache),
                                      allow_patterns=ALLOW_PATTERNS, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        pass
    where = (f"not a local path, and not in the Hugging Face cache {cache} "
             f"(revision {revision or 'main'})")
    if hub_offline():
        raise ModelDirectoryError(f"model {model}: {where}; HF_HUB_OFFLINE is set, so "
                                  "nothing was downloaded") from None
    try:
        return Path(snapshot_download(model, revision=revision, cache_dir=str(cache),
                                      allow_patterns=ALLOW_PATTERNS))
    except Exception as exc:  # the hub client raises many kinds: each is this one failure
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelDirectoryError(f"model {model}: {where}, and the download failed: "
                                  f"{first}") from None
