"""Sweeps over Ray give the serial results; the result cache makes a rerun (or a resumed,
killed sweep) compute only what is missing."""

import json

import pytest

from flowyard import sweep as sweeps
from flowyard.cli import main
from flowyard.sweep import Pending, ResultCache, Sweep

GOODPUT = ["goodput", "--trace", "azure-conv", "--duration", "40", "--instances", "2",
           "--policies", "vllm,round-robin", "--tol", "0.25", "--quiet"]


def _goodput(tmp_path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert main([*GOODPUT, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_ray_goodput_equals_serial(tmp_path) -> None:
    pytest.importorskip("ray")
    serial = _goodput(tmp_path, "serial")
    parallel = _goodput(tmp_path, "ray", "--ray", "--ray-workers", "2")
    assert parallel == serial
    assert all(len(r["curve"]) >= 2 for r in serial["results"])


def test_cache_resumes_a_killed_sweep(tmp_path) -> None:
    cache = tmp_path / "cache"
    first = _goodput(tmp_path, "first", "--cache", str(cache))
    files = sorted(cache.rglob("*.pkl"))
    assert len(files) == sum(len(r["curve"]) for r in first["results"])
    for f in files[::2]:  # a sweep killed half way: only some results were written
        f.unlink()
    calls = []
    real = sweeps.jobs.attainment

    def counting(cfg, w):
        calls.append(cfg.policy)
        return real(cfg, w)

    sweeps.jobs.attainment = counting
    try:
        again = _goodput(tmp_path, "again", "--cache", str(cache))
    finally:
        sweeps.jobs.attainment = real
    assert again == first
    assert len(calls) == len(files[::2])  # only the missing ones ran
    assert len(list(cache.rglob("*.pkl"))) == len(files)


def test_cache_key_includes_revision(tmp_path) -> None:
    a, b = ResultCache(tmp_path, revision="r1"), ResultCache(tmp_path, revision="r2")
    a.put(("x", 1), 0.5)
    assert a.get(("x", 1)) == 0.5 and b.get(("x", 1)) is None and ("x", 1) in a


def test_source_key_follows_the_package_not_the_commit(tmp_path) -> None:
    """A commit outside flowyard/ keeps the cache's key (a sweep resumes across it); a change
    inside it, committed, uncommitted or a new untracked module, gives a new key."""
    import subprocess

    from flowyard.sweep.cache import source_key

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True)

    assert source_key(tmp_path) == ""  # not a checkout
    (tmp_path / "flowyard").mkdir()
    (tmp_path / "flowyard" / "a.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("r\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "one")
    first = source_key(tmp_path)
    assert first.startswith("tree ") and "+" not in first
    (tmp_path / "README.md").write_text("r2\n")
    git("commit", "-qam", "docs only")
    assert source_key(tmp_path) == first
    (tmp_path / "flowyard" / "a.py").write_text("x = 2\n")
    dirty = source_key(tmp_path)
    assert dirty.startswith(first + "+")
    (tmp_path / "flowyard" / "a.py").write_text("x = 1\n")
    (tmp_path / "flowyard" / "new.py").write_text("y = 1\n")
    assert source_key(tmp_path) not in (first, dirty)
    git("add", "-A")
    git("commit", "-qm", "code")
    assert source_key(tmp_path).startswith("tree ") and source_key(tmp_path) != first


def test_rounds_ask_everything_then_repeat() -> None:
    """A parallel sweep's pass goes on past a pending result where the body allows it; the
    last pass sees only known values (a stub backend computes the asked-for results)."""

    class Stub(Sweep):
        def _compute(self, wanted: dict) -> None:
            for key, (fn, args) in wanted.items():
                self._store(key, fn(*args))

    s = Stub(ray=True)
    seen = []

    def body():
        out = []
        for x in (1, 2, 3):
            out.append(s.attempt(lambda x=x: s.value(("sq", x), lambda v: v * v, x), None))
        seen.append(list(out))
        return out

    assert s.run(body) == [1, 4, 9]
    assert seen == [[None, None, None], [1, 4, 9]] and s.computed == 3
    with pytest.raises(ValueError):
        Stub(ray=True).run(lambda: (_ for _ in ()).throw(ValueError("real error")))
    with pytest.raises(Pending):
        s.blocked()


def test_bad_sweep_flags() -> None:
    assert main([*GOODPUT, "--ray-workers", "0"]) == 2


def test_digests_do_not_keep_every_workload_alive() -> None:
    """A reproduction hashes thousands of workloads (a Ray pass builds them again): the digest
    memo must not hold them all. Found when `reproduce all --ray` grew to 16 GB."""
    import gc
    import tracemalloc

    from flowyard.sweep.runner import digest
    from flowyard.workloads import fixed_shape

    def one_round(seed: int) -> None:
        w = fixed_shape(64, 8, 500, rate=1.0, seed=seed)
        assert digest(w) == digest(w)  # memoised while it lives

    gc.collect()
    tracemalloc.start()
    try:
        one_round(0)  # warm: first-call allocations are not a workload's
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        one_round(1)
        gc.collect()
        size = tracemalloc.get_traced_memory()[0] - base  # one more workload held by the memo
        for seed in range(2, 200):
            one_round(seed)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert size > 0 and kept < 100 * size, f"{kept / size:.0f} workloads' worth kept after 200"
    w = fixed_shape(64, 8, 500, rate=1.0, seed=1)
    assert digest(w) == digest(fixed_shape(64, 8, 500, rate=1.0, seed=1))  # content, not identity
