"""Build-on-first-use C kernels: compile a source in this package with the machine's compiler
and cache the shared object, for `ringserve.gpu.attention.cpu_native` (paged decode attention)
and `ringserve.gpu.native.panel` (the panel matmuls and the fused decode step).

The compiler is `$CC`, else `cc`. The shared object is cached under `RINGSERVE_HOME/kernels/`,
named by a hash of the source, the compiler and its version, the flags and the CPU's model and
feature flags (what `-march=native` compiles for), so a cache shared between machines never
loads a build for another CPU. A build writes a private file and renames it into place, so
processes racing to build the same kernel never load a half-written one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ringserve import envs

# -O3 and the host's vector units; OpenMP links the libgomp torch has loaded, so kernels run on
# torch's threads.
OPENMP_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")


def compiler() -> str | None:
    """The C compiler to use (`$CC`, else `cc`), or None when there is none."""
    return shutil.which(os.environ.get("CC") or "cc")


def cpu_signature() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def build_library(source: Path | Sequence[Path], name: str, cc: str, flags: Sequence[str],
                  libs: Sequence[str] = (), headers: Sequence[Path] = ()) -> ctypes.CDLL:
    """Load `source` compiled with `cc` and `flags` (built now unless cached).

    Args:
        source: the C file, or the C files of one library (compiled together, with their
            directory on the include path).
        name: the cached file's prefix (`{name}-{hash}.so`).
        cc: the compiler (`compiler()`).
        flags: compiler flags (e.g. OPENMP_FLAGS).
        libs: linker arguments after the source (e.g. ["-lm"]).
        headers: the headers the sources include (hashed with them, so an edit rebuilds).

    Raises:
        OSError: the compiler failed, or the library does not load.
        subprocess.SubprocessError: the compiler timed out.
    """
    sources = [source] if isinstance(source, Path) else list(source)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True,
                             timeout=30).stdout
    texts = [f.read_text() for f in [*sources, *headers]]
    digest = hashlib.sha256("\0".join(
        [*texts, cc, *flags, *libs, version, cpu_signature()]).encode()
    ).hexdigest()[:16]
    path = envs.ringserve_home() / "kernels" / f"{name}-{digest}.so"
    if not path.exists():
        includes = sorted({f"-I{f.parent}" for f in sources})
        _compile(cc, sources, path, [*flags, *includes], libs)
    return ctypes.CDLL(str(path))


def _compile(cc: str, sources: Sequence[Path], path: Path, flags: Sequence[str],
             libs: Sequence[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        result = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources), *libs],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise OSError(f"{cc} failed: {result.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
