# Sourced by scripts/test and scripts/serve (not run on its own): cd to the project root,
# build .venv when missing or stale (pyproject.toml changed), and point every cache inside the
# project (no home-directory or hub writes). Sets ROOT.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

stamp="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ ! -x .venv/bin/python || "$(cat .venv/.stamp 2>/dev/null)" != "$stamp" ]]; then
    echo "== creating .venv" >&2
    rm -rf .venv
    "$PY" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
    # torch first and pinned: any looser spec would pull a multi-GB CUDA build.
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    .venv/bin/python -m pip install --quiet -e ".[test]"
    echo "$stamp" > .venv/.stamp
fi

export RINGSERVE_HOME="$ROOT/.cache/ringserve"
export HF_HOME="$ROOT/.cache/hf"
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export TORCHINDUCTOR_CACHE_DIR="$ROOT/.cache/inductor"
export TRITON_CACHE_DIR="$ROOT/.cache/triton"
