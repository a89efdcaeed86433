"""Every figure and table of the four papers, and what in flowyard reproduces it (or why nothing does).

A reader of a report should be able to tell, for each of a paper's figures, whether this project
reran it and where, without trusting a hand-kept list in prose. `REGISTRY` is that list, kept in
one place: each `Figure` names the function that computes its counterpart (`built_by`,
"module:attribute", checked importable by the tests) or says why it is not built (`why`). Each
report's "figures not reproduced" section is generated from it by `not_built_section`, and
`rendered` reads back which figures a report shows so a test can hold the two together. A few
claims tied to no figure (an abstract's number, a section's measurement) are registered under
their section's name so they are listed too.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

PAPERS: tuple[str, ...] = ("flowprefill", "dynaserve", "pla-serve", "arrow")

_DIAGRAM = "a diagram of the design, no measurement to rerun"


@dataclass(frozen=True, slots=True)
class Figure:
    """One figure, table or figure-less claim of a paper. Exactly one of `built_by` (the
    "module:attribute" that computes our counterpart, plus `part`: where in its result) and
    `why` (the reason nothing does) is set."""

    paper: str
    label: str  # "Fig. 9", "Table 2", or a section ("§4.2", "abstract") for a claim tied to no figure
    title: str
    built_by: str = ""
    part: str = ""
    why: str = ""

    def __post_init__(self) -> None:
        if self.paper not in PAPERS:
            raise ValueError(f"unknown paper {self.paper!r}; papers: {', '.join(PAPERS)}")
        if bool(self.built_by) == bool(self.why):
            raise ValueError(f"{self.paper} {self.label}: set exactly one of built_by and why")

    @property
    def built(self) -> bool:
        return bool(self.built_by)

    def resolve(self) -> object:
        """The object `built_by` names (ImportError/AttributeError when it does not exist)."""
        mod, _, attr = self.built_by.partition(":")
        obj: object = importlib.import_module(mod)
        for a in attr.split(".") if attr else []:
            obj = getattr(obj, a)
        return obj


def _f(paper: str, label: str, title: str, built_by: str = "", part: str = "", why: str = "") -> Figure:
    return Figure(paper, label, title, built_by, part, why)


_FP, _FPN = "flowyard.experiments.flowprefill:run_experiments", "flowyard.experiments.flowprefill_notes:cost_figures"
_DS, _DSN = "flowyard.experiments.dynaserve:run_experiments", "flowyard.experiments.dynaserve_notes:lcu_decodes"
_PLA = "flowyard.experiments.pla_serve:run_experiments"
_AR = "flowyard.experiments.arrow:run_experiments"

REGISTRY: tuple[Figure, ...] = (
    # ------------------------------------------------------------------ FlowPrefill
    _f("flowprefill", "Fig. 1", "request lengths and arrival patterns per task in QwenTrace",
       why="a characterisation of QwenTrace, which is not public; the stand-in's task mix (Table 1's shares "
           "and length fits) is stated in the Setup"),
    _f("flowprefill", "Fig. 2", "prefill granularities against a TTFT SLO", why=_DIAGRAM),
    _f("flowprefill", "Fig. 3", "chunked prefill of a 32K prompt by chunk size (Llama3-8B)", _FPN,
       "priced by the cost model (a lone prefill needs no simulation)"),
    _f("flowprefill", "Fig. 4", "throughput and TTFT of a lone prefill by input length (Llama3-8B)", _FPN,
       "priced by the cost model"),
    _f("flowprefill", "Fig. 5", "overview of FlowPrefill", why=_DIAGRAM),
    _f("flowprefill", "Fig. 6", "preemption-check boundaries in the execution hierarchy", why=_DIAGRAM),
    _f("flowprefill", "Fig. 7", "cooperative preemption process", why=_DIAGRAM),
    _f("flowprefill", "Fig. 8", "two requests of different priorities, an example", why=_DIAGRAM),
    _f("flowprefill", "Table 1", "prompt length per task in the evaluation trace", _FP,
       "input: the QwenTrace stand-in `qwentrace_like` takes its task shares and lengths"),
    _f("flowprefill", "Table 2", "TTFT SLO per task and model", _FP, "input: each task's SLO in the workload"),
    _f("flowprefill", "Fig. 9", "goodput and min SLO scale of three models", _FP, "Results.e2e"),
    _f("flowprefill", "Fig. 10", "S-EDF vs EDF vs D-EDF", _FP, "Results.priority"),
    _f("flowprefill", "Fig. 11", "batch token budgets and no batching", _FP, "Results.budget"),
    _f("flowprefill", "Fig. 12", "preemption blocking time, operator vs layer boundaries", _FP, "Results.blocking"),
    _f("flowprefill", "Fig. 13", "real vs predicted TTFT",
       why="the simulator's step times are the predictor's own cost model, so prediction is exact by "
           "construction and the figure would be a diagonal"),
    _f("flowprefill", "Fig. 14", "single-SLO workload (ShareGPT)",
       why="its point is operator-level preemption's overhead, which is zero in the simulator (a preemption "
           "check costs nothing here); with one SLO S-EDF reduces to FCFS by arrival"),
    _f("flowprefill", "Fig. 15", "FlowPrefill with chunked prefill by chunk size", _FP, "Results.chunk"),
    _f("flowprefill", "Fig. 16", "PD colocation with TTFT and TBT attainment (1.6x)", _FP,
       "Results.colocation (`flowprefill-colocated`: S-EDF on a colocated chunked core, no operator-level preemption)"),
    _f("flowprefill", "Fig. 17", "MoE Qwen3-30B-A3B (1.6x goodput, 2.4x tighter SLO)", _FP,
       "Results.moe (flowprefill_moe.run_moe; SLOs from the Table 2 row of the nearest-capacity model)"),
    # ------------------------------------------------------------------ DynaServe
    _f("dynaserve", "Fig. 1", "latency-throughput trade-off of colocation and disaggregation", why=_DIAGRAM),
    _f("dynaserve", "Fig. 2", "colocation, disaggregation and micro-request architectures", why=_DIAGRAM),
    _f("dynaserve", "Fig. 3", "per-minute prompt and response tokens of Azure Code and BurstGPT",
       why="a trace plot, not a serving result; the bundled BurstGPT is its 400-row public head, too sparse "
           "for per-minute curves"),
    _f("dynaserve", "Fig. 4", "adaptive request partition (micro-requests)", why=_DIAGRAM),
    _f("dynaserve", "Fig. 5", "one 1024+1024 request split at each position over two GPUs",
       why="the split search runs on every point of Figs. 8-9 and Table 2; one request on an idle pair would "
           "show only the KV hand-off and our link model, since a weight-bound decode step is nearly flat"),
    _f("dynaserve", "Fig. 6", "mixed-batch latency and TFLOP/s against decode count", _DSN,
       "the LCU point only, priced by the cost model; a fit input of the 'published' calibration"),
    _f("dynaserve", "Fig. 7", "chunk-by-chunk KV transfer",
       why=_DIAGRAM + "; the 94 % exposed-transfer claim it illustrates is measured (Chunked KV transfer)"),
    _f("dynaserve", "Table 1", "fixed shapes on two A100: MFU, HBM, TBT, throughput", _DS, "Results.table1"),
    _f("dynaserve", "Fig. 8", "goodput against request rate, three models, four workloads", _DS, "Results.curves"),
    _f("dynaserve", "Fig. 9", "serving capacity (P99 TBT within SLO)", _DS, "Results.capacity"),
    _f("dynaserve", "Table 2", "hybrid workload: capacity and goodput", _DS, "Results.hybrid"),
    _f("dynaserve", "Fig. 10", "goodput every 6 min over BurstGPT's 311th hour",
       why="that hour is not in the public 400-row head of BurstGPT bundled here"),
    _f("dynaserve", "Fig. 11", "TBT CDF with and without SLO-aware batching (52 % -> 99 % of tokens)", _DS,
       "Results.slo_batching (DynaServeConfig.slo_batching=False: a fixed prefill budget per step)"),
    _f("dynaserve", "Table 3", "global scheduler overhead per request (C++)",
       why="a wall-clock cost of the implementation, not a simulated quantity; "
           "`python benchmarks/dynaserve_split_cost.py` measures our Python split search"),
    _f("dynaserve", "Table 4", "goodput under output-length prediction error", _DS, "Results.sensitivity"),
    # ------------------------------------------------------------------ PLA-Serve
    _f("pla-serve", "Fig. 1", "P90 TTFT of long prefills as short-prefill concurrency grows",
       why="interference inside a step: the roofline prices a batch by its operators with no cross-class term, "
           "so a rerun would show only queueing, which Figs. 6-7 show"),
    _f("pla-serve", "Fig. 2", "token lengths of LMSys-Chat-1M multi-turn dialogues",
       why="LMSys-Chat-1M is not bundled (no offline copy here); the stand-in conversations' lengths are in the Setup"),
    _f("pla-serve", "Table 1", "task classes SPSD/SPLD/LPSD/LPLD", why="definitions, no measurement"),
    _f("pla-serve", "Fig. 3", "P90 TTFT of short prefills as long-prefill concurrency grows",
       why="as Fig. 1: the roofline has no cross-class interference term"),
    _f("pla-serve", "Fig. 4", "tensor-core and memory utilisation during multi-turn inference",
       why="per-kernel hardware utilisation needs a real GPU; the roofline only says which bound a step hits"),
    _f("pla-serve", "Fig. 5", "latency and throughput against a fixed waiting window",
       why="a graph replay is priced by an assumed saving (`RooflineParams.graph_saving`), so the curve would "
           "trace our assumption rather than measure CUDA graphs"),
    _f("pla-serve", "Fig. 6", "PLA-Serve vs SGLang on one H200 node, 1P and 8P", _PLA,
       "Results.fig6 (Qwen2.5-14B only)"),
    _f("pla-serve", "Fig. 7", "TTFT-SLO violations against concurrency", _PLA, "Results.fig7"),
    _f("pla-serve", "Table 2", "deadline-free distillation end-to-end time, 4P+4D", _PLA, "Results.distill"),
    _f("pla-serve", "Fig. 8", "prefill throughput of PD vs mixed with decode (pla-mix)",
       why="`pla-mix` runs the decodes inside every PLA step (the core's continuous batching), so it lacks the "
           "missing-continuous-batching mechanism the figure measures"),
    _f("pla-serve", "Fig. 6 (7B, 32B)", "Fig. 6's Qwen2.5-7B and 32B panels",
       why="not run: the experiment fixes one model (pla_serve.MODEL = Qwen2.5-14B); both models are in the catalog, so "
           "this is a settings change, not a missing capability"),
    _f("pla-serve", "§4.2", "CUDA graph memory (228-277 MB) and capture time (8-12 s)",
       why="memory and capture time of real CUDA graphs need a GPU; the simulator prices a replay, not a capture"),
    _f("pla-serve", "abstract", "prefill latency, SLO violations (multi-instance) and throughput (Qwen2.5-32B)",
       why="tied to no figure or setting the text gives; the 32B model is not run (see Fig. 6 (7B, 32B))"),
    # ------------------------------------------------------------------ Arrow
    _f("arrow", "Fig. 1", "input/output tokens per minute over time in four traces",
       why="a trace characterisation, not a serving result; the windows the experiment replays are described "
           "in the Setup"),
    _f("arrow", "Fig. 2", "input and output length distributions of the traces",
       why="a trace characterisation, not a serving result"),
    _f("arrow", "Fig. 3", "request timeline in PD disaggregation", why=_DIAGRAM),
    _f("arrow", "Fig. 4", "prefill and decode load over time, 4P4D on Azure Conversation",
       why="the experiment records goodput per rate, not a load time series; the simulator's --timeline could "
           "draw one but no experiment does"),
    _f("arrow", "Fig. 5", "Arrow architecture", why=_DIAGRAM),
    _f("arrow", "Fig. 6", "request processing workflow in Arrow", why=_DIAGRAM),
    _f("arrow", "Table 1", "workloads and SLO settings", _AR, "input: each trace's SLOs in the Setup"),
    _f("arrow", "Fig. 7", "four systems under four traces and rates", _AR, "Results.workloads (end-to-end curves)"),
    _f("arrow", "Fig. 8", "request and instance scheduling strategies", _AR, "Results.workloads (strategy curves)"),
    _f("arrow", "Fig. 9", "goodput by number of GPUs", _AR, "Results.scale (curves; the paper's claim, 'nearly linear', is qualitative, so no ratio is judged)"),
)


def registry(paper: str) -> list[Figure]:
    """The registered figures of `paper`, in the paper's order."""
    if paper not in PAPERS:
        raise ValueError(f"unknown paper {paper!r}; papers: {', '.join(PAPERS)}")
    return [f for f in REGISTRY if f.paper == paper]


def lookup(paper: str, label: str) -> Figure:
    for f in registry(paper):
        if f.label == label:
            return f
    raise KeyError(f"{paper} {label} is not registered in flowyard.experiments.figures")


_REF = re.compile(r"\b(Fig(?:ure|s?\.)?|Tables?)\s?(\d+)((?:\s*(?:,|and|-|–)\s*\d+)*)", re.I)


def mentioned(text: str) -> set[str]:
    """Normalised labels ("Fig. 9", "Table 2") of every figure or table `text` refers to, "Figs. 3
    and 4" and "Figs. 8-9" included."""
    out: set[str] = set()
    for m in _REF.finditer(text):
        kind = "Table" if m.group(1).lower().startswith("table") else "Fig."
        nums = [int(m.group(2))] + [int(x) for x in re.findall(r"\d+", m.group(3) or "")]
        if m.group(3) and re.search(r"[-–]", m.group(3)) and len(nums) == 2:
            nums = list(range(nums[0], nums[1] + 1))
        out.update(f"{kind} {n}" for n in nums)
    return out


NOT_BUILT_HEADING = "## Figures not reproduced, and why"


def rendered(markdown: str) -> set[str]:
    """The figures a report shows results for: those named in its headings and in the claim column
    of its "ours vs paper" tables, outside the "not reproduced" section."""
    from flowyard.experiments.report import verdict_rows

    shown: set[str] = set()
    skip = False
    for line in markdown.splitlines():
        if line.startswith("#"):
            skip = line.strip() == NOT_BUILT_HEADING
            if not skip:
                shown |= mentioned(line)
    return shown | set().union(*(mentioned(c) for c in verdict_rows(markdown)))


def not_built_section(paper: str, details: Mapping[str, str] | None = None, notes: Iterable[str] = ()) -> str:
    """The body of a report's "figures not reproduced" section, generated from the registry: one
    line per figure not built, with its reason and any `details` this run computed for it (label ->
    text), then `notes` (lines about the reproduction that are not figures)."""
    figs = registry(paper)
    details = dict(details or {})
    unknown = set(details) - {f.label for f in figs}
    if unknown:
        raise KeyError(f"details for unregistered {paper} figures: {', '.join(sorted(unknown))}")
    built = [f.label for f in figs if f.built]
    lines = [f"{len(figs)} figures, tables and figure-less claims of the paper are registered in "
             f"`flowyard/experiments/figures.py`; {len(built)} have a counterpart ({', '.join(built)}), "
             f"{len(figs) - len(built)} do not:", ""]
    for f in figs:
        if not f.built:
            lines.append(f"- **{f.label}** ({f.title}): {f.why}." + (f" {details[f.label]}" if f.label in details else ""))
        elif f.label in details:
            lines.append(f"- **{f.label}** ({f.title}, {f.part}): {details[f.label]}")
    lines += list(notes)
    return "\n".join(lines)


__all__ = ["Figure", "NOT_BUILT_HEADING", "PAPERS", "REGISTRY", "lookup", "mentioned", "not_built_section",
           "registry", "rendered"]
