"""Kinds of events that drive schedulers, shared by both executors.

The simulator keeps them in a heap as (time, kind, seq, payload) tuples; the value order of
the kinds is the tie-break at equal times (arrivals are seen before a step that ends at the
same instant, as in a real engine loop that drains its input queue before scheduling).
The runtime delivers the same kinds through asyncio queues.
"""

from __future__ import annotations

import enum


class EventKind(enum.IntEnum):
    ARRIVAL = 0  # a request reaches the cluster (payload: RequestState)
    STEP_DONE = 1  # an instance finished the step(s) it was running (payload: instance, version)
    KV_DONE = 2  # a KV transfer landed (payload: state, src, dst)
    PREEMPT_ACK = 3  # a running prefill stopped at an operator boundary (FlowPrefill)
    TIMER = 4  # a periodic controller tick or a batching window closes
    SCHEDULE = 5  # an idle instance picks its next step, after every other event of this instant
    CLIENT = 6  # a simulated benchmark client finishes reading a token (`sim.client_cpu`)
