"""Large workloads from the bundled traces: tiling in time and superposing several traces.

A thousand simulated instances need a thousand times the traffic of one. Rate scaling alone
(`scale_rate`) compresses a trace's hour into seconds; tiling first keeps the run long enough
to reach steady state and gives it as many requests as wanted, and superposing traces mixes
their shapes (conversation, code, bursts) at their own rates:

    flowyard simulate --trace azure-conv --tile 52 --rate-scale 125 --instances 1000
    flowyard simulate --trace azure-conv --mix azure-code:2,burstgpt:50 --instances 64

Both keep every request's lengths, SLO and task; later copies of a multi-turn session get
their own session name (`s` becomes `s#k`), so prefix caching and session affinity see
distinct conversations, as the copies would be in a real service.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from flowyard.core.request import Request
from flowyard.workloads.workload import Workload


def tile(w: Workload, copies: int, gap: float = 1.0) -> Workload:
    """The trace repeated `copies` times back to back (copy k starts `gap` seconds after copy
    k-1's last arrival): the same load for copies x as long, with copies x the requests."""
    if copies < 1:
        raise ValueError(f"--tile must be at least 1, got {copies}")
    if copies == 1:
        return w
    span = w.duration + gap
    n = len(w.requests)
    reqs = [_copy(r, k, k * n + r.id, r.arrival + k * span) for k in range(copies) for r in w.requests]
    return w.derive(reqs, normalize_order=False)


def overlay(parts: Sequence[Workload], name: str | None = None) -> Workload:
    """Several workloads on one time axis (their rates add), merged by arrival time; ids are
    renumbered in arrival order and sessions are kept apart by the part they came from."""
    if not parts:
        raise ValueError("overlay needs at least one workload")
    if len(parts) == 1:
        return parts[0]
    reqs = [_copy(r, k, r.id, r.arrival) for k, w in enumerate(parts) for r in w.requests]
    reqs.sort(key=lambda r: r.arrival)  # stable: ties keep the order of the parts
    base = parts[0]
    return Workload(name or "+".join(w.name for w in parts), [replace(r, id=i) for i, r in enumerate(reqs)],
                    base.source, sum(w.dropped for w in parts), base.format)


def parse_mix(text: str) -> list[tuple[str, float]]:
    """`--mix NAME[:SCALE],...` -> [(trace name or path, rate scale)]; scale defaults to 1."""
    out: list[tuple[str, float]] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, _, scale = item.rpartition(":") if ":" in item else (item, "", "1")
        try:
            factor = float(scale)
        except ValueError:
            raise ValueError(f"--mix entry {item!r}: the rate scale after ':' must be a number") from None
        if not (factor > 0 and factor < float("inf")):
            raise ValueError(f"--mix entry {item!r}: the rate scale must be positive")
        out.append((name, factor))
    if not out:
        raise ValueError("--mix needs at least one NAME[:SCALE] entry")
    return out


def mixed(base: Workload, spec: str, load: Callable[[str], Workload]) -> Workload:
    """`base` with every trace of `spec` (`parse_mix`) loaded by `load`, rate-scaled by its
    factor and clipped to base's span, superposed on it."""
    from flowyard.workloads.transforms import clip, scale_rate

    parts = [base]
    for name, factor in parse_mix(spec):
        w = scale_rate(load(name), factor)
        if base.duration > 0:
            w = clip(w, duration=base.duration + 1e-9)
        parts.append(w)
    return overlay(parts)


def _copy(r: Request, k: int, rid: int, arrival: float) -> Request:
    session = r.session if (k == 0 or r.session is None) else f"{r.session}#{k}"
    if rid == r.id and arrival == r.arrival and session == r.session:
        return r
    return replace(r, id=rid, arrival=arrival, session=session)
