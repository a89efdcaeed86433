"""Pure workload transforms: rate scaling, clipping, SLO and task assignment, sessions.

Each function returns a new `Workload` and leaves its argument untouched (`Request` is
frozen; changes go through `dataclasses.replace`), so one loaded trace can feed many runs.
Whenever the order or the selection of requests changes, ids are renumbered 0..n-1 and the
first arrival is rebased to 0.0 (the `Workload` invariant).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import numpy as np

from flowyard.core.request import SLO, Request
from flowyard.workloads.workload import Workload


def scale_rate(w: Workload, factor: float) -> Workload:
    """Arrow's rate scaling: every timestamp times 1/factor (factor 2 = twice the rate).

    Unlike Poisson re-timing this keeps the trace's burst structure, only compressed.
    """
    if not (factor > 0 and np.isfinite(factor)):
        raise ValueError(f"rate scale factor must be a positive number, got {factor!r}")
    k = 1.0 / factor
    return w.derive([replace(r, arrival=r.arrival * k) for r in w.requests], normalize_order=False)


def clip(
    w: Workload, start: float = 0.0, duration: float | None = None, max_requests: int | None = None
) -> Workload:
    """Requests arriving in [start, start + duration), then at most the first `max_requests`.

    The window is rebased so its first request arrives at 0.0. Used to replay a slice of an
    hour-long trace (`--duration`) or a fixed number of requests in quick tests.
    """
    if start < 0:
        raise ValueError(f"clip start must be >= 0, got {start}")
    if duration is not None and duration < 0:
        raise ValueError(f"clip duration must be >= 0, got {duration}")
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"clip max_requests must be >= 0, got {max_requests}")
    end = float("inf") if duration is None else start + duration
    kept = [r for r in w.requests if start <= r.arrival < end]
    if max_requests is not None:
        kept = kept[:max_requests]
    return w.derive(kept)


def with_slo(
    w: Workload, ttft: float | None = None, tpot: float | None = None, tbt: float | None = None
) -> Workload:
    """Set the given SLO fields on every request; a None argument leaves that field as it was.

    This is what `--ttft-slo` / `--tpot-slo` do: override whatever the workload carried.
    """
    new = {k: v for k, v in (("ttft", ttft), ("tpot", tpot), ("tbt", tbt)) if v is not None}
    if not new:
        return w.derive(w.requests, normalize_order=False)
    return w.derive([replace(r, slo=replace(r.slo, **new)) for r in w.requests], normalize_order=False)


def parse_slo_by_length(text: str | Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """'L1:S1,L2:S2,...' (or pairs) → [(min_prompt_len, ttft_s), ...] sorted by length.

    Raises ValueError naming the bad item: lengths must be integers >= 0 and distinct, SLOs
    positive seconds.
    """
    if isinstance(text, str):
        items = [s.strip() for s in text.split(",") if s.strip()]
        if not items:
            raise ValueError(f"TTFT-SLO-by-length spec is empty: {text!r} (expected 'L1:S1,L2:S2,...')")
        pairs: list[tuple[object, object]] = []
        for it in items:
            parts = it.split(":")
            if len(parts) != 2:
                raise ValueError(f"bad TTFT-SLO-by-length item {it!r}: expected 'min_prompt_len:ttft_seconds'")
            pairs.append((parts[0].strip(), parts[1].strip()))
    else:
        pairs = list(text)
        if not pairs:
            raise ValueError("TTFT-SLO-by-length spec is empty")
    out: list[tuple[int, float]] = []
    for length, slo in pairs:
        try:
            lv = int(length)  # type: ignore[call-overload]
            if isinstance(length, float) and not length.is_integer():
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"bad prompt length {length!r} in TTFT-SLO-by-length spec: not an integer") from None
        try:
            sv = float(slo)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"bad TTFT SLO {slo!r} for length {lv}: not a number of seconds") from None
        if lv < 0:
            raise ValueError(f"bad prompt length {lv} in TTFT-SLO-by-length spec: must be >= 0")
        if not (sv > 0 and np.isfinite(sv)):
            raise ValueError(f"bad TTFT SLO {slo!r} for length {lv}: must be positive seconds")
        out.append((lv, sv))
    out.sort()
    dup = [a for (a, _), (b, _) in zip(out, out[1:]) if a == b]
    if dup:
        raise ValueError(f"prompt length {dup[0]} appears twice in TTFT-SLO-by-length spec")
    return out


def slo_by_length(w: Workload, spec: str | Sequence[tuple[int, float]]) -> Workload:
    """Heterogeneous TTFT SLOs by prompt length (`--ttft-slo-by-length`).

    A request gets the SLO of the largest L_i <= prompt_len: long prompts may take longer to
    first token, as in PLA-Serve's and FlowPrefill's length-dependent SLOs. Requests shorter
    than every L_i keep their TTFT SLO; TPOT/TBT are never touched.
    """
    table = parse_slo_by_length(spec)
    bounds = np.array([l for l, _ in table])
    slos = [s for _, s in table]
    out: list[Request] = []
    for r in w.requests:
        i = int(np.searchsorted(bounds, r.prompt_len, side="right")) - 1
        out.append(r if i < 0 else replace(r, slo=replace(r.slo, ttft=slos[i])))
    return w.derive(out, normalize_order=False)


def assign_tasks(w: Workload, mix: Mapping[str, tuple[float, SLO]], seed: int | None = 0) -> Workload:
    """Multi-SLO workloads (FlowPrefill Table 2): each request draws a task by weight.

    `mix` maps task name → (weight, SLO); the request gets that task tag and that SLO
    (replacing its previous one). Deterministic for a seed.
    """
    if not mix:
        raise ValueError("task mix is empty")
    names = list(mix)
    weights = np.array([float(mix[n][0]) for n in names])
    if np.any(weights < 0) or not np.isfinite(weights).all() or weights.sum() <= 0:
        raise ValueError(f"task weights must be >= 0 with a positive sum, got {dict(zip(names, weights))}")
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(names), size=len(w.requests), p=weights / weights.sum())
    out = [replace(r, task=names[k], slo=mix[names[k]][1]) for r, k in zip(w.requests, pick)]
    return w.derive(out, normalize_order=False)


def slo_by_task(w: Workload, slos: Mapping[str, SLO], default: SLO | None = None) -> Workload:
    """SLO per existing task tag (e.g. BurstGPT's `ChatGPT` vs `GPT-4`).

    Requests whose task is not in `slos` get `default`, or keep their SLO when it is None.
    """
    out: list[Request] = []
    for r in w.requests:
        s = slos.get(r.task) if r.task is not None else None
        s = s if s is not None else default
        out.append(r if s is None else replace(r, slo=s))
    return w.derive(out, normalize_order=False)


def multi_turn_sessions(
    w: Workload,
    turns_mean: float = 3.0,
    seed: int | None = 0,
    *,
    max_new_tokens: int | None = None,
    think_time: float = 10.0,
    decode_time_per_token: float = 0.03,
    max_prompt_len: int | None = None,
) -> Workload:
    """Chain a conversation trace's requests into multi-turn sessions (PLA-Serve re-prefill).

    Construction, in trace order:
    - the number of turns of each session is drawn from a geometric distribution with mean
      `turns_mean` (>= 1); that many consecutive requests become turns 0, 1, ... of it;
    - turn 0 is the trace request as is (its arrival, prompt, output);
    - turn k > 0 carries the conversation so far: prompt = prev prompt + prev output + its own
      trace prompt (the new user message, capped at `max_new_tokens` when given: PLA-Serve
      observes that most follow-up messages are a few dozen tokens), and `history_len` = prev prompt + prev output (the
      part whose KV an instance may still hold); the output is its own trace output;
    - turn k arrives `decode_time_per_token * prev output + Exp(think_time)` seconds after
      turn k - 1 (roughly: the reply is streamed, then the user reads and types). Under
      overload a turn can arrive before its predecessor finishes; a simulator that enforces
      session order should hold it back;
    - a turn whose prompt would exceed `max_prompt_len` (a model's context) starts a new
      session instead.
    Sessions are named "s0", "s1", ...; block hashes are dropped (they no longer describe the
    prompt). The result has as many requests as the input, re-sorted and renumbered.
    """
    if not turns_mean >= 1:
        raise ValueError(f"turns_mean must be >= 1, got {turns_mean}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if think_time < 0 or decode_time_per_token < 0:
        raise ValueError("think_time and decode_time_per_token must be >= 0")
    rng = np.random.default_rng(seed)
    out: list[Request] = []
    reqs = w.requests
    i, sid = 0, 0
    while i < len(reqs):
        n_turns = int(rng.geometric(1.0 / turns_mean))
        prev: Request | None = None
        for _ in range(n_turns):
            if i >= len(reqs):
                break
            r = reqs[i]
            if prev is None:
                cur = replace(r, session=f"s{sid}", turn=0, history_len=0, block_hashes=(), hash_block_size=0)
            else:
                hist = prev.prompt_len + prev.target_output
                new = r.prompt_len if max_new_tokens is None else min(r.prompt_len, max_new_tokens)
                plen = hist + new
                if max_prompt_len is not None and plen > max_prompt_len:
                    break  # this request opens the next session
                think = float(rng.exponential(think_time)) if think_time > 0 else 0.0
                gap = decode_time_per_token * prev.target_output + think
                cur = replace(
                    r, arrival=prev.arrival + gap, prompt_len=plen, history_len=hist,
                    session=f"s{sid}", turn=prev.turn + 1, block_hashes=(), hash_block_size=0,
                )
            out.append(cur)
            prev = cur
            i += 1
        sid += 1
    return w.derive(out)


__all__ = [
    "scale_rate", "clip", "with_slo", "parse_slo_by_length", "slo_by_length",
    "assign_tasks", "slo_by_task", "multi_turn_sessions",
]
