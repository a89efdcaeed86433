"""What happened in a run, on one time axis, as a Chrome/Perfetto trace.

Both executors feed the same recorder: the steps each instance ran, the KV transfers between
instances, the cluster core's decisions (routes, splits, hand-offs, decode routes, migrations,
flips, preemptions, rejections) and every request's span from arrival through its first token
to its end, whatever the end (finished, aborted, rejected, failed); an instance's death and
its replacement's rejoining are instant events on that instance. `flowyard simulate --timeline PATH` and `flowyard serve --timeline PATH` write it;
open the file in https://ui.perfetto.dev or chrome://tracing. Each instance is a process
(its steps on one thread, its decisions and transfers on others); requests are threads of a
"requests" process.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flowyard.cluster.core import DecisionLog
from flowyard.core.plan import StepPlan
from flowyard.core.request import RequestState

REQUESTS_PID = 1_000_000  # the "process" that holds one track per request
STEP_TID, DECISION_TID, KV_TID = 0, 1, 2


@dataclass
class Timeline:
    log: DecisionLog = field(default_factory=DecisionLog)  # unbounded: the whole run
    roles: dict[int, str] = field(default_factory=dict)
    steps: list[tuple[int, float, float, str, dict]] = field(default_factory=list)
    transfers: list[tuple[int, int, int, float, float]] = field(default_factory=list)
    spans: list[tuple[int, int | None, float, float | None, float | None, str]] = field(default_factory=list)
    # (time, instance, kind, detail): an instance died ("down") or its replacement rejoined ("up")
    events: list[tuple[float, int, str, str]] = field(default_factory=list)

    def step(self, instance: int, start: float, end: float, plan: StepPlan, steps: int = 1,
             preempted: bool = False) -> None:
        """An instance ran `plan` (`steps` times, a decode run) from start to end."""
        name = "prefill" if plan.prefills else "decode"
        if plan.prefills and plan.decodes:
            name = "mixed"
        if preempted:
            name += " (preempted)"
        args = {"prefill_tokens": sum(s.n for s in plan.prefills), "decode_seqs": len(plan.decodes),
                "steps": steps, "requests": sorted({s.state.id for s in plan.prefills} | {d.id for d in plan.decodes})}
        if steps == 1:  # the batch as a cost model prices it (flowyard.costmodel.serving fits on it)
            args["shape"] = asdict(plan.shape())
        self.steps.append((instance, start, end, name, args))

    def step_summary(self, instance: int, start: float, end: float, name: str, args: dict) -> None:
        """A step reported by a remote instance (already summarised there)."""
        self.steps.append((instance, start, end, name, args))

    def transfer(self, request: int, src: int, dst: int, start: float, end: float) -> None:
        """A request's KV moved from src to dst over [start, end]."""
        self.transfers.append((request, src, dst, start, end))

    def finished(self, st: RequestState) -> None:
        """A request ended (finished, rejected or failed): its span."""
        self.spans.append((st.id, st.instance, st.req.arrival, st.first_token_time, st.finish_time,
                           st.status.value))

    def ended(self, st: RequestState, end: float, status: str) -> None:
        """A request that ended abnormally where no step saw it end: aborted by its client,
        rejected on arrival, or failed (its instance died, nowhere to continue)."""
        self.spans.append((st.id, st.instance, st.req.arrival, st.first_token_time, end, status))

    def instance_event(self, instance: int, kind: str, t: float, detail: str = "") -> None:
        """An instance died ("down") or its replacement rejoined ("up")."""
        self.events.append((t, instance, kind, detail))

    # -- output ---------------------------------------------------------------------------------
    def kinds(self) -> set[str]:
        """The kinds of event in the trace (what the two-executor test compares)."""
        out = {name.split(" ")[0] for _, _, _, name, _ in self.steps} | self.log.kinds()
        if self.transfers:
            out.add("kv")
        if self.spans:
            out.add("request")
        return out | {kind for _, _, kind, _ in self.events}

    def to_chrome(self) -> dict:
        us = 1e6
        ev: list[dict] = []
        instances = sorted({s[0] for s in self.steps} | set(self.roles) | {e[1] for e in self.events}
                           | {d.src for d in self.log.decisions if d.src is not None}
                           | {d.dst for d in self.log.decisions if d.dst is not None})
        for i in instances:
            role = f" ({self.roles[i]})" if i in self.roles else ""
            ev.append({"ph": "M", "name": "process_name", "pid": i, "args": {"name": f"instance {i}{role}"}})
            for tid, name in ((STEP_TID, "steps"), (DECISION_TID, "decisions"), (KV_TID, "KV in")):
                ev.append({"ph": "M", "name": "thread_name", "pid": i, "tid": tid, "args": {"name": name}})
        ev.append({"ph": "M", "name": "process_name", "pid": REQUESTS_PID, "args": {"name": "requests"}})
        for i, start, end, name, args in self.steps:
            ev.append({"ph": "X", "cat": "step", "name": name, "pid": i, "tid": STEP_TID, "ts": start * us,
                       "dur": max(0.0, end - start) * us, "args": args})
        for d in self.log.decisions:
            where = d.dst if d.kind in ("route", "reject") and d.dst is not None else d.src
            ev.append({"ph": "i", "s": "t", "cat": "decision", "name": d.kind, "ts": d.t * us,
                       "pid": REQUESTS_PID if where is None else where, "tid": DECISION_TID,
                       "args": {"request": d.request, "src": d.src, "dst": d.dst, "detail": d.detail}})
        for t, inst, kind, detail in self.events:  # process-wide markers: a death is not one step's
            name = {"down": "instance died", "up": "instance rejoined"}.get(kind, kind)
            ev.append({"ph": "i", "s": "p", "cat": "instance", "name": name, "ts": t * us, "pid": inst,
                       "tid": STEP_TID, "args": {"detail": detail}})
        for rid, src, dst, start, end in self.transfers:
            ev.append({"ph": "X", "cat": "kv", "name": f"KV of {rid} from {src}", "pid": dst, "tid": KV_TID,
                       "ts": start * us, "dur": max(0.0, end - start) * us, "args": {"request": rid, "src": src}})
        for rid, held_on, arrival, first, ended, status in self.spans:
            base = {"pid": REQUESTS_PID, "tid": rid, "cat": "request"}
            stop = ended if ended is not None else (first if first is not None else arrival)
            ev.append({**base, "ph": "X", "name": f"request {rid}", "ts": arrival * us,
                       "dur": max(0.0, stop - arrival) * us, "args": {"instance": held_on, "status": status}})
            if first is not None:
                ev.append({**base, "ph": "X", "name": "waiting for first token", "ts": arrival * us,
                           "dur": max(0.0, first - arrival) * us})
        return {"traceEvents": ev, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome()))
