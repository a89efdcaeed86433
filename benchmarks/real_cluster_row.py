"""One row of a real-cluster run: a policy on a workload, its real goodput search, its
simulated one and its fixed-rate point (real_cluster.py's main loop, one cell of it).

Without `--observed-speed` every real point is served by the row's one server and the simulator
is clocked by the speed checks around the points. With it, each real point gets a fresh server
that records a timeline, and the row is simulated once more from the speeds its served steps ran
at (real_cluster_observed.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from real_cluster_fixed import add_observed, fixed_row, point_of
from real_cluster_lib import RealWorkload, Server, real_point, real_states, served_clock, sim_point, sim_states
from real_cluster_observed import ServedRuns, add_served_clock
from real_cluster_speed import checked_point, row_drift, row_speed


@dataclass(frozen=True)
class RowSetup:
    """What every row of one policy on one executor shares."""

    policy: str
    executor: str
    profile: Path  # the profile the row is simulated with (and its server predicts with)
    cost: object  # that profile's cost model
    fit: dict | None  # the executor's served-step terms (--fit-serving)
    check: object  # the speed check (real_cluster_speed.SpeedCheck) against that profile
    model: str | None
    work: Path
    evals: int
    repeats: int  # the fixed point is served this many times
    observe: bool  # --observed-speed

    @property
    def shared(self) -> bool:
        return self.executor == "local"

    def clock(self, speed: float = 1.0, drift=None):
        return served_clock(self.profile, self.fit, self.cost, speed, drift)

    def server(self, tag: str) -> Server:
        return Server(self.policy, self.executor, self.profile, self.model, self.work / f"serve-{tag}.log")


def measure_row(s: RowSetup, name: str, w: RealWorkload, fw: RealWorkload, slos, url: str | None) -> dict:
    """The row of `s.policy` on workload `w` (fixed point on `fw`), served at `url` (None with
    `s.observe`: a fresh server per point)."""
    from real_cluster import sim_search, search  # the script's own module: imported when called

    sim = sim_search(w, s.policy, s.clock(), s.shared, s.cost)
    guess = sim.goodput if sim.goodput > 0 else w.guess
    speeds: list[list[float]] = []  # [rate, the machine's speed right before it]
    drifts: list[list[float]] = []  # [rate, prompt steps' speed, decodes' speed]
    observed: list[list[float]] = []  # [rate, served steps' speed, prompt steps', decodes'] (observe)
    runs = ServedRuns(s.server, s.work, f"{s.policy}-{s.executor}-{name}", s.clock()) if s.observe else None

    def serve(rate: float) -> dict:
        if runs is None:
            return real_point(url, w, rate, slos)
        got = point_of(runs.states(w, rate, slos))
        observed.append([rate, *runs.speeds[-1]])
        return got

    real = search(lambda r: checked_point(s.check, speeds, r, serve, drifts)["attainment"], guess, s.evals, s.policy)
    row: dict = {"real_speeds": speeds, "real_drifts": drifts}
    if row_speed(row) != 1.0:  # the simulated search again, on the machine the real one ran on
        sim = sim_search(w, s.policy, s.clock(row_speed(row), row_drift(row)), s.shared, s.cost)
    row.update(real_goodput=real.goodput, sim_goodput=sim.goodput, real_curve=real.curve, sim_curve=sim.curve)
    fixed = w.fixed_rate
    fixed_runs = ServedRuns(s.server, s.work, f"{s.policy}-{s.executor}-{name}-fixed", s.clock()) if s.observe else None

    def serve_fixed() -> list:
        return fixed_runs.states(fw, fixed, slos) if fixed_runs else real_states(url, fw, fixed, slos)

    def simulate_fixed(speed: float, drift) -> list:
        return sim_states(fw, fixed, s.policy, s.clock(speed, drift), s.shared, s.cost)

    row.update(fixed_row(s.check, serve_fixed, simulate_fixed, s.repeats))
    if fixed_runs is not None:
        add_observed(row, fixed_runs.speeds, simulate_fixed)
        row["real_observed"] = observed
        add_served_clock(row, lambda sp, dr: sim_search(w, s.policy, s.clock(sp, dr), s.shared, s.cost),
                         lambda r, sp, dr: sim_point(w, r, s.policy, s.clock(sp, dr), s.shared, s.cost)["attainment"],
                         simulate_fixed)
    return row
