"""A result cache for sweeps, keyed by source revision and configuration, so a sweep that was
killed resumes where it stopped and a finished one reruns instantly.

One file per simulation under the cache directory, named by the SHA-256 of (revision, key).
The revision is the git tree of the checkout's `flowyard/` sources plus a hash of their
uncommitted changes (or the package version outside a git checkout): a code change never
returns a result computed by other code, and a commit outside the package (tests, docs,
reports) does not throw the finished results away. Files are written to a temporary name and renamed, so a kill
mid-write leaves no half file behind.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path(os.environ.get("FLOWYARD_CACHE", Path.home() / ".cache" / "flowyard" / "sweeps"))


def source_key(root: Path) -> str:
    """What the results of a checkout at `root` depend on: the git tree of its `flowyard/`
    sources, plus a hash of their uncommitted changes and untracked files. A commit that touches
    only tests, docs or benchmarks keeps the key, so a sweep resumes across it; any change to
    the package gives a new key. "" when `root` is not a git checkout."""
    def git(*args: str) -> bytes:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=30).stdout

    try:
        tree = git("rev-parse", "HEAD:flowyard").decode().strip()
        if not tree:
            return ""
        extra = hashlib.sha256(git("diff", "HEAD", "--", "flowyard"))
        for name in sorted(git("ls-files", "--others", "--exclude-standard", "--", "flowyard").decode().split()):
            extra.update(name.encode() + b"\0" + (root / name).read_bytes())
    except (OSError, subprocess.SubprocessError):
        return ""
    clean = extra.digest() == hashlib.sha256(b"").digest()
    return f"tree {tree}" + ("" if clean else "+" + extra.hexdigest()[:16])


@lru_cache(maxsize=1)
def code_revision() -> str:
    """The key of this flowyard's sources (`source_key`), or its package version outside git."""
    key = source_key(Path(__file__).resolve().parents[2])
    if key:
        return key
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "flowyard " + version("flowyard")
    except PackageNotFoundError:
        return "unknown"


class ResultCache:
    """Pickled results by key (any value with a stable repr: tuples of settings and digests)."""

    def __init__(self, directory: str | Path = DEFAULT_DIR, revision: str | None = None) -> None:
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise OSError(f"cache directory '{self.dir}' exists and is not a directory")
        self.revision = revision if revision is not None else code_revision()
        self.hits = self.stores = 0

    def path(self, key: Any) -> Path:
        h = hashlib.sha256(repr((self.revision, key)).encode()).hexdigest()
        return self.dir / h[:2] / f"{h}.pkl"

    def get(self, key: Any, default: Any = None) -> Any:
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                value = pickle.load(f)
        except FileNotFoundError:
            return default
        except (pickle.UnpicklingError, EOFError, OSError):  # damaged: compute it again
            return default
        self.hits += 1
        return value

    def __contains__(self, key: Any) -> bool:
        return self.path(key).exists()

    def put(self, key: Any, value: Any) -> None:
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.stores += 1
