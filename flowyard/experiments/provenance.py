"""Where a report's numbers come from: revision, command, seeds, machine, wall time and the cost
model's settings, recorded in every report and `results.json` so a reader can rerun any of them.

A report made from code that is not committed cannot be traced to a revision, so `begin` refuses a
dirty checkout unless the caller allows it, and then the report's first line says so. The
cost-model settings are read from the `SimConfig` the runs start from, by field name
(`COST_MODEL_FIELD_WORDS`), so a field added there later (an engine profile) is recorded with no
change here.

`run_experiment` opens a `recording` around the report writer; `Report` reads `current()`, so
the reports need no extra argument. A report written outside it (a test calling a writer
directly) still records revision and machine, with the command it was given.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

#: the checkout a report's code comes from (this package's repository)
SOURCE_ROOT = Path(__file__).resolve().parents[2]
#: what counts as the source when judging a checkout dirty (reports under docs/ do not)
SOURCE_PATHS = ("flowyard", "pyproject.toml")
#: ... and for a benchmark's report, the benchmark scripts as well (not their results)
BENCHMARK_PATHS = SOURCE_PATHS + ("benchmarks/*.py",)
#: a SimConfig field whose name holds one of these words is a cost-model setting and is recorded
COST_MODEL_FIELD_WORDS = ("calibration", "profile")
DIRTY_LINE = "**Made from uncommitted code**"


class DirtyTreeError(ValueError):
    """The checkout has uncommitted source changes and the caller did not allow it."""


@dataclass(frozen=True)
class GitState:
    revision: str  # full commit hash; "" outside a git checkout
    dirty: tuple[str, ...] = ()  # `git status --porcelain` lines of the source paths

    @property
    def short(self) -> str:
        return self.revision[:7]


def git_state(root: Path | None = None, paths: tuple[str, ...] = SOURCE_PATHS) -> GitState:
    """The commit checked out at `root` (None: SOURCE_ROOT) and its uncommitted changes under
    `paths` (untracked files included: a new module is code the revision does not hold)."""
    root = SOURCE_ROOT if root is None else root

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=20).stdout

    try:
        rev = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--", *paths) if rev else ""
    except (OSError, subprocess.SubprocessError):
        return GitState("")
    return GitState(rev, tuple(line for line in status.splitlines() if line.strip()))


def machine() -> dict[str, Any]:
    """The machine a run used: enough to tell two runs' machines apart and compare wall times."""
    cpu = platform.processor()
    try:  # a VM's model name can be as vague as "AMD EPYC": family and model tell hosts apart
        first = Path("/proc/cpuinfo").read_text(encoding="utf-8").split("\n\n")[0]  # one CPU's block
        info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
        cpu = info.get("model name", cpu)
        if "cpu family" in info and "model" in info:
            cpu += f" (family {info['cpu family']} model {info['model']})"
    except OSError:
        pass
    return {"host": platform.node(), "system": f"{platform.system()} {platform.release()}",
            "arch": platform.machine(), "cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version()}


def _plain(v: Any) -> Any:
    """A JSON-safe form of a config value (paths and objects as text)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {k: _plain(x) for k, x in dataclasses.asdict(v).items()}
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


def cost_model_settings(sim: Any = None) -> dict[str, Any]:
    """The cost-model settings (`COST_MODEL_FIELD_WORDS` fields: calibration, engine profile) of
    `sim`, the SimConfig the runs start from (None: the simulator's defaults, what every
    experiment builds on)."""
    if sim is None:
        from flowyard.sim.run import SimConfig

        sim = SimConfig()
    out = {f.name: _plain(getattr(sim, f.name)) for f in dataclasses.fields(sim)
           if any(w in f.name for w in COST_MODEL_FIELD_WORDS)}
    if "engine_profile" in out:  # None means the process default ($FLOWYARD_ENGINE_PROFILE): name it
        from flowyard.costmodel.engines import get_engine_profile

        out["engine_profile"] = get_engine_profile(getattr(sim, "engine_profile")).name
    return out


@dataclass
class Provenance:
    """One run's record. `wall_s` is NaN until `finish`."""

    revision: str
    dirty: tuple[str, ...]
    command: str
    seeds: tuple[int, ...]
    machine: dict[str, Any]
    cost_model: dict[str, Any]
    started_utc: str
    wall_s: float = float("nan")
    _t0: float = field(default_factory=time.perf_counter, repr=False)

    def finish(self) -> "Provenance":
        self.wall_s = time.perf_counter() - self._t0
        return self

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if not k.startswith("_")}
        d["dirty"] = list(self.dirty)
        d["seeds"] = list(self.seeds)
        d["wall_s"] = None if self.wall_s != self.wall_s else round(self.wall_s, 3)
        return d

    def first_line(self) -> str:
        """The line a report made from uncommitted code opens with ("" for a clean revision)."""
        if not self.dirty:
            return ""
        files = ", ".join(s[3:] for s in self.dirty[:5]) + (", …" if len(self.dirty) > 5 else "")
        # "revision <hash> + uncommitted changes" is the form Report.changes reads back from an old report
        return (f"{DIRTY_LINE} (revision {self.revision[:7] or 'unknown'} + uncommitted changes, to {files}; "
                "written with --allow-dirty): no revision holds the code that produced these numbers.")

    def section(self) -> str:
        """The report's "Provenance" section: every field, as markdown."""
        m = self.machine
        rows = [
            ("revision", (self.revision or "unknown (not a git checkout)")
             + (" + uncommitted changes" if self.dirty else "")),
            ("command", f"`{self.command}`" if self.command else "not recorded (report written outside "
                                                                  "`flowyard reproduce`)"),
            ("seeds", ", ".join(map(str, self.seeds)) or "not recorded"),
            ("machine", f"{m.get('host')}: {m.get('cpu')} ({m.get('cpus')} CPUs), {m.get('system')} {m.get('arch')}, "
                        f"Python {m.get('python')}"),
            ("wall time", "n/a" if self.wall_s != self.wall_s else f"{self.wall_s:.0f} s"),
            ("started (UTC)", self.started_utc),
            ("cost model", ", ".join(f"{k} = {json.dumps(v)}" for k, v in self.cost_model.items()) or "defaults"),
        ]
        return "\n".join(["| field | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def begin(command: str = "", seeds: tuple[int, ...] = (), *, allow_dirty: bool = False, sim: Any = None,
          root: Path | None = None) -> Provenance:
    """Start a run's record; refuse (DirtyTreeError) a checkout with uncommitted source changes
    unless `allow_dirty`. `root`: the checkout (None: SOURCE_ROOT, this package's)."""
    root = SOURCE_ROOT if root is None else root
    g = git_state(root)
    if g.dirty and not allow_dirty:
        raise DirtyTreeError(
            f"the checkout at {root} has uncommitted changes ({len(g.dirty)} file(s) under "
            f"{', '.join(SOURCE_PATHS)}, e.g. {g.dirty[0][3:]}): a report made from them could not be traced to a "
            "revision. Commit them, or pass --allow-dirty (the report then says it was made from uncommitted code)")
    return Provenance(g.revision, g.dirty, command, tuple(seeds), machine(), cost_model_settings(sim),
                      datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"))


_CURRENT: list[Provenance] = []


@contextmanager
def recording(p: Provenance) -> Iterator[Provenance]:
    """Make `p` the record reports written inside this block use."""
    _CURRENT.append(p)
    try:
        yield p
    finally:
        _CURRENT.pop()


def current(command: str = "") -> Provenance:
    """The record of the run being written up; outside `recording`, a fresh one (revision, machine
    and cost model now; dirty allowed, and said) with `command`."""
    return _CURRENT[-1] if _CURRENT else begin(command, allow_dirty=True)


__all__ = ["COST_MODEL_FIELD_WORDS", "DIRTY_LINE", "DirtyTreeError", "GitState", "Provenance", "begin",
           "cost_model_settings", "current", "git_state", "machine", "recording"]
