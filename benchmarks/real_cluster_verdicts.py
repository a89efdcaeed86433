"""The real-cluster report's verdicts, judged on what the searches located, not on a point.

A goodput search on real servers tries few rates (each is minutes of serving), so it locates
a goodput between the highest rate that met the target and the lowest above it that did not:
a bracket, often a factor 2 wide. Reading its lower end as the goodput turns the bracket's
width into a "simulator error" and orders policies the measurement cannot tell apart. So each
verdict here is one of three: proven for every value in the brackets, disproven for every
value, or undecided because the brackets are too wide.
"""

from __future__ import annotations

import math

TARGET = 0.9  # SLO attainment that counts as meeting the SLOs


def bracket(row: dict, key: str = "real") -> tuple[float, float]:
    """(lo, hi): the goodput is at least lo and below hi (hi = inf when no rate above lo
    failed: the search ran out of rates). A row without a curve is a point (lo == hi)."""
    g = float(row[f"{key}_goodput"])
    curve = row.get(f"{key}_curve")
    if curve is None:
        return g, g
    above = [r for r, a in curve if r > g and a < TARGET - 1e-9]
    return g, (min(above) if above else math.inf)


def sim_vs_real(sim: float, lo: float, hi: float, band: float = 0.2) -> str:
    """'within' if the simulated goodput is within `band` of every real value in [lo, hi),
    'off' if it is off by more than `band` from all of them, else 'undecided'."""
    if lo <= 0 and sim <= 0:
        return "undecided"  # neither met the SLOs at the lowest rate tried
    if lo > 0 and sim / (1 + band) <= lo and hi <= sim / (1 - band):
        return "within"
    if hi <= sim / (1 + band) or (lo > 0 and lo >= sim / (1 - band)):
        return "off"
    return "undecided"


def distance(sim: float, lo: float, hi: float) -> float:
    """Relative distance of `sim` outside [lo, hi) (0 inside): a lower bound on its error."""
    if sim < lo:
        return (sim - lo) / lo
    if math.isfinite(hi) and sim > hi:
        return (sim - hi) / hi
    return 0.0


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a of two rankings (pairs tied in either count as neither)."""
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            if a[i] != a[j] and b[i] != b[j]:
                s += int(math.copysign(1, a[i] - a[j]) * math.copysign(1, b[i] - b[j]))
    pairs = n * (n - 1) / 2
    return s / pairs if pairs else math.nan


def resolved_tau(real: list[tuple[float, float]], sim: list[float]) -> tuple[float, int, int]:
    """Kendall's tau over the pairs the real brackets order (one bracket wholly below the
    other), with (pairs ordered, all pairs): overlapping brackets rank nothing."""
    n, s, ordered = len(real), 0, 0
    for i in range(n):
        for j in range(i + 1, n):
            (lo_i, hi_i), (lo_j, hi_j) = real[i], real[j]
            if hi_i <= lo_j:
                sign = -1
            elif hi_j <= lo_i:
                sign = 1
            else:
                continue
            ordered += 1
            if sim[i] != sim[j]:
                s += sign * int(math.copysign(1, sim[i] - sim[j]))
    pairs = n * (n - 1) // 2
    return (s / ordered if ordered else math.nan), ordered, pairs


def ratio_bounds(mine: tuple[float, float], others: list[tuple[float, float]]) -> tuple[float, float]:
    """Bounds on my goodput over the best other's, from the brackets."""
    best_lo = max(lo for lo, _ in others)
    best_hi = max(hi for _, hi in others)
    low = mine[0] / best_hi if best_hi > 0 else math.inf
    high = mine[1] / best_lo if best_lo > 0 else math.inf
    return low, high


def _err(sim: float, real: float) -> float:
    return (sim - real) / real if real and math.isfinite(real) and math.isfinite(sim) else math.nan


def _pct(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:+.0%}"


def _x(v: float) -> str:
    return "∞" if not math.isfinite(v) else f"{v:.2f}×"


def _taus(mine: list[dict], key: str = "sim_goodput") -> list[tuple[str, float, int, int]]:
    """(workload, τ, pairs ordered, pairs) for each workload of three policies or more whose rows
    all have the simulated goodput `key`."""
    out = []
    for wl in sorted({r["workload"] for r in mine}):
        cell = [r for r in mine if r["workload"] == wl]
        if len(cell) >= 3 and all(key in r for r in cell):
            out.append((wl, *resolved_tau([bracket(r) for r in cell], [r[key] for r in cell])))
    return out


def _tau_line(taus: list[tuple[str, float, int, int]]) -> str:
    ok = all(t >= 0.7 for _, t, n, _ in taus if n)
    some = any(n for _, _, n, _ in taus)
    return (", ".join(f"{w} {t:.2f} over {n} of {m} pairs" if n else f"{w} no pair ordered" for w, t, n, m in taus)
            + f" — target ≥ 0.7 per workload: {('met on the ordered pairs' if ok else 'not met') if some else 'undecided'}")


def _fid_line(mine: list[dict], key: str = "sim_goodput") -> str:
    fid = {"within": 0, "off": 0, "undecided": 0}
    for r in mine:
        fid[sim_vs_real(r[key], *bracket(r))] += 1
    return (f"{fid['within']} of {len(mine)} cells; off by more than 20 %: {fid['off']}; "
            f"undecided (bracket too wide): {fid['undecided']}")


def verdicts(rows: list[dict], expected: int = 7) -> list[str]:
    """The issue's targets, judged from the rows' brackets (no data: 'not measured');
    `expected` policies make a complete workload."""
    out = []
    for ex in sorted({r["executor"] for r in rows}):
        mine = [r for r in rows if r["executor"] == ex]
        wins = []
        for wl in sorted({r["workload"] for r in mine}):
            cell = {r["policy"]: r for r in mine if r["workload"] == wl}
            fy = cell.get("flowyard")
            others = [bracket(r) for p, r in cell.items() if p != "flowyard"]
            if fy is not None and others and max(hi for _, hi in others) > 0:
                wins.append((wl, *ratio_bounds(bracket(fy), others), len(cell)))
        if wins:  # "best other" means every other policy: a workload with some unmeasured cannot meet it
            met = any(lo >= 1.2 and n >= expected for _, lo, _, n in wins)
            partial = any(lo >= 1.2 for _, lo, _, _ in wins)
            missed = all(hi < 1.2 for _, _, hi, _ in wins)
            verdict = ("met" if met else "not met" if missed else
                       "undecided (met only over the policies measured so far)" if partial else
                       "undecided (brackets too wide)")
            out.append(f"- {ex}: flowyard / best other real goodput: "
                       + ", ".join(f"{w} {_x(lo)}–{_x(hi)}" + (f" (over {n - 1} of {expected - 1} others)"
                                                                 if n < expected else "")
                                   for w, lo, hi, n in wins)
                       + f" — target ≥ 1.2× on one workload: {verdict}")
        else:
            out.append(f"- {ex}: flowyard / best other real goodput: not measured")
        taus = _taus(mine)
        out.append(f"- {ex}: Kendall τ (simulated ranking vs the pairs the real brackets order): {_tau_line(taus)}"
                   if taus else f"- {ex}: Kendall τ: not measured")
        out.append(f"- {ex}: simulated goodput within 20 % of every real value its bracket allows: {_fid_line(mine)}")
        out.append(f"- {ex}: per-request {_within(mine, 'sim')}")
        loro = [r for r in mine if r.get("sim_loro")]
        if loro:
            out.append(f"- {ex}: per-request, each run clocked at the other runs' served step speeds (leave one "
                       f"run out): {_within(loro, 'sim_loro')}")
        out += _served_lines(ex, mine)
    return out


def _served_lines(ex: str, mine: list[dict]) -> list[str]:
    """The targets again with the simulator clocked by the served steps (`--observed-speed`)."""
    served = [r for r in mine if "sim_goodput_served" in r]
    out = []
    if served:
        taus = _taus(served, "sim_goodput_served")
        out.append(f"- {ex}, clocked by the served steps of the row's other real points (leave the bracket out): "
                   f"simulated goodput within 20 % of every real value its bracket allows: "
                   f"{_fid_line(served, 'sim_goodput_served')}"
                   + (f"; Kendall τ {_tau_line(taus)}" if taus else ""))
    fixed = [r for r in mine if r.get("sim_served")]
    if fixed:
        out.append(f"- {ex}: per-request, clocked at the search points' served step speeds: "
                   f"{_within(fixed, 'sim_served')}")
    return out


def _within(rows: list[dict], sim: str) -> str:
    """How many simulated P50s (`rows`' `sim` points) are within 15 % of the real ones, P90s within 25 %."""
    errs = [abs(_err(r[sim][k], r["real"][k])) for r in rows for k in ("ttft_p50", "tpot_p50")]
    errs90 = [abs(_err(r[sim][k], r["real"][k])) for r in rows for k in ("ttft_p90", "tpot_p90")]
    return (f"P50 within 15 %: {sum(e <= 0.15 for e in errs)} of {len(errs)}; "
            f"P90 within 25 %: {sum(e <= 0.25 for e in errs90)} of {len(errs90)}")
