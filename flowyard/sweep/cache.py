"""A result cache for sweeps, keyed by source revision and configuration, so a sweep that was
killed resumes where it stopped and a finished one reruns instantly.

One file per simulation under the cache directory, named by the SHA-256 of (revision, key).
The revision is the flowyard checkout's commit plus a hash of its uncommitted changes to
`flowyard/` (or the package version outside a git checkout): a code change never returns a
result computed by other code. Files are written to a temporary name and renamed, so a kill
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


@lru_cache(maxsize=1)
def code_revision() -> str:
    """The commit of the flowyard sources and a hash of their uncommitted changes."""
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        diff = subprocess.run(["git", "-C", str(root), "diff", "HEAD", "--", "flowyard"], capture_output=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        rev, diff = "", b""
    if not rev:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return "flowyard " + version("flowyard")
        except PackageNotFoundError:
            return "unknown"
    return rev + ("+" + hashlib.sha256(diff).hexdigest()[:16] if diff else "")


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
