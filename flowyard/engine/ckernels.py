"""Build and load the engine's small C kernels (flowyard/engine/csrc/*.c) with ctypes.

A kernel is compiled on first use with the machine's C compiler (`CC`, else `cc`) into a
per-user cache ($FLOWYARD_CACHE, else $XDG_CACHE_HOME/flowyard, else ~/.cache/flowyard, then
kernels/), under a name keyed by the source, the compiler, the flags and the CPU's feature
flags (a -march=native build must not move to another CPU). Objects are built in a temporary
directory and renamed into place, so processes that build at once do not clash.

OpenMP kernels run on the threads PyTorch already has: torch's libgomp.so.1 is loaded (by
importing torch) before the kernel, so the kernel binds to it by soname. -ffast-math, where a
kernel wants it, is given only when compiling: linking with it would add crtfastmath.o, which
turns on flush-to-zero for the whole process.

`load(source)` returns the loaded library, or None (with the reason logged once) where there is
no compiler or the build fails; callers then keep their PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads libgomp.so.1 before any kernel that needs it)

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
COMPILE = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c")
LINK = ("-shared", "-fopenmp")


def cache_dir() -> Path:
    root = os.environ.get("FLOWYARD_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME")
                                                            or os.path.expanduser("~/.cache"), "flowyard")
    return Path(root) / "kernels"


def cpu_id() -> str:
    """The CPU's feature flags (Linux), else what platform knows of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(source: str | os.PathLike, compile_flags=COMPILE, link_flags=LINK, cc: str | None = None) -> Path:
    """Compile `source` (once per source, compiler, flags and CPU) and return the shared object.
    Raises RuntimeError without a compiler or when compiling fails."""
    source = Path(source)
    cc = cc or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH")
    key = hashlib.sha256(source.read_bytes() + " ".join([cc, *compile_flags, *link_flags, cpu_id()]).encode())
    out = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = os.path.join(tmp, "k.o"), os.path.join(tmp, "k.so")
        try:
            subprocess.run([cc, *compile_flags, str(source), "-o", obj], check=True, capture_output=True, text=True)
            subprocess.run([cc, *link_flags, obj, "-o", lib, "-lm"], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"compiling {source.name} failed: {e.stderr.strip()[-500:]}") from e
        os.replace(lib, out)
    return out


def load(source: str | os.PathLike, compile_flags=COMPILE, link_flags=LINK, what: str = "") -> ctypes.CDLL | None:
    """The compiled `source` loaded with ctypes, or None where it cannot be built or loaded
    (logged as a warning naming `what` the caller does instead)."""
    try:
        return ctypes.CDLL(str(build(source, compile_flags, link_flags)))
    except (RuntimeError, OSError) as e:
        log.warning("C kernel %s unavailable (%s)%s", Path(source).name, e, f"; {what}" if what else "")
        return None
