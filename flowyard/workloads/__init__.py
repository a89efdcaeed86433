"""Workloads: real-trace loaders, synthetic arrivals, transforms and the bundled catalog.

Typical use::

    from flowyard.workloads import load_trace, scale_rate, clip, with_slo
    w = with_slo(clip(scale_rate(load_trace("azure-conv"), 2.0), duration=600), ttft=1.0, tpot=0.1)
"""

from flowyard.workloads.arrivals import (
    ARRIVAL_PROCESSES,
    DEFAULT_RATE,
    gamma_arrivals,
    make_arrivals,
    poisson_arrivals,
    retime,
)
from flowyard.workloads.catalog import (
    TRACE_NAMES,
    UnknownTraceError,
    describe_traces,
    load_trace,
    trace_file,
)
from flowyard.workloads.loaders import (
    FORMATS,
    MOONCAKE_BLOCK,
    TIMED_FORMATS,
    detect_format,
    load_azure,
    load_burstgpt,
    load_file,
    load_lengths,
    load_mooncake,
    load_vidur,
    read_text,
)
from flowyard.workloads.multitask import (
    QWENTRACE_TASKS,
    QWENTRACE_TTFT_SLO,
    ShiftedWeibull,
    TaskStats,
    fit_shifted_weibull,
    qwentrace_like,
    sample_prompt_lens,
    scale_slo,
    task_length_dist,
    task_slos,
)
from flowyard.workloads.synthetic import fixed_shape, from_lengths, mix, reasoning_like, resample
from flowyard.workloads.transforms import (
    assign_tasks,
    clip,
    multi_turn_sessions,
    parse_slo_by_length,
    scale_rate,
    slo_by_length,
    slo_by_task,
    with_slo,
)
from flowyard.workloads.workload import Workload, WorkloadError, build_requests, normalize

__all__ = [
    "ARRIVAL_PROCESSES", "DEFAULT_RATE", "FORMATS", "MOONCAKE_BLOCK", "TIMED_FORMATS", "TRACE_NAMES",
    "UnknownTraceError", "Workload", "WorkloadError",
    "assign_tasks", "build_requests", "clip", "describe_traces", "detect_format", "gamma_arrivals",
    "load_azure", "load_burstgpt", "load_file", "load_lengths", "load_mooncake", "load_trace",
    "load_vidur", "make_arrivals", "multi_turn_sessions", "normalize", "parse_slo_by_length",
    "poisson_arrivals", "read_text", "retime", "scale_rate", "slo_by_length", "slo_by_task",
    "trace_file", "with_slo",
    "QWENTRACE_TASKS", "QWENTRACE_TTFT_SLO", "ShiftedWeibull", "TaskStats", "fit_shifted_weibull",
    "qwentrace_like", "sample_prompt_lens", "scale_slo", "task_length_dist", "task_slos",
    "fixed_shape", "from_lengths", "mix", "reasoning_like", "resample",
]
