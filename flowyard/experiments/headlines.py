"""The README's inline numbers, read back from the generated reports they summarise.

A sentence such as "cross-validated median 11.4 %" is only true of the report it was copied
from, and copies rot when the report is regenerated. So each such number in README.md sits
between inline markers, `<!-- gen:NAME -->value<!-- /gen:NAME -->`, and this module computes
every NAME's value from the committed report; `python -m flowyard.experiments.summary --readme`
rewrites them and a test fails when the README and the reports disagree.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

MARK = re.compile(r"<!-- gen:([a-z0-9-]+) -->(.*?)<!-- /gen:\1 -->", re.S)


def _fidelity(md: str) -> dict[str, str]:
    """The cross-validated headline of docs/results/fidelity_published.md."""
    row = re.search(r"^\| \*\*cross-validated\*\* \| (\d+) \| \*\*([\d.]+)%\*\* \| \*\*([\d.]+)%\*\* \|", md, re.M)
    insample = re.search(r"^\| in-sample \| (\d+) \|", md, re.M)
    families = re.search(r"For each of the (\d+) source families", md)
    targets = re.search(r"^Targets \(issue 27\): (.*?)\.?$", md, re.M)
    if not (row and insample and families and targets):
        raise ValueError("fidelity report: no cross-validated headline table")
    return {"fid-cv-median": f"{row.group(2)} %", "fid-cv-max": f"{row.group(3)} %",
            "fid-points": insample.group(1), "fid-sources": families.group(1), "fid-targets": targets.group(1)}


def _real_cluster(md: str) -> dict[str, str]:
    """The flowyard-over-best bracket and the simulator's placement in docs/results/real_cluster.md."""
    ratios = re.findall(r"flowyard / best other real goodput: (.*?) — target", md)
    if not ratios:
        raise ValueError("real-cluster report: no 'flowyard / best other' verdict")
    spans = [f"{w} {s.strip()}" for r in ratios
             for w, s in re.findall(r"([a-z-]+) ([\d.]+×–[\d.∞]+×?(?: \(over \d+ of \d+ others\))?)", r)]
    lines = md.split("\n## Clocked by the served steps")[0].splitlines()  # that section's table repeats the rows
    cells = [line.split("|") for line in lines
             if re.match(r"^\| (local|ray) \| [a-z-]+ \| `[a-z0-9-]+` \| [\d.]+ – [\d.∞]+ \|", line)]
    header = next((line.split("|") for line in lines if "| sim outside |" in line), None)
    if not cells or not spans or header is None:
        raise ValueError("real-cluster report: no goodput table")
    col = [c.strip() for c in header].index("sim outside")  # later columns may follow it
    inside = sum(1 for c in cells if c[col].strip() == "+0%")
    p50 = re.findall(r"^- (local|ray): per-request P50 within 15 %: (\d+ of \d+); P90 within 25 %: (\d+ of \d+)", md, re.M)
    within = re.findall(r"^- (?:local|ray): simulated goodput within 20 % of every real value its bracket allows: "
                        r"(\d+ of \d+) cells", md, re.M)
    taus = [f"{w} {t}" for line in re.findall(r"^- (?:local|ray): Kendall τ [^:]*: (.*)$", md, re.M)
            for w, t in re.findall(r"([a-z-]+) ([\d.-]+) over", line)]
    loro = re.findall(r"^- (local|ray): per-request, each run clocked at the other runs' served step speeds "
                      r"\(leave one run out\): P50 within 15 %: (\d+ of \d+); P90 within 25 %: (\d+ of \d+)", md, re.M)
    served = re.findall(r"^- (?:local|ray), clocked by the served steps [^:]*: simulated goodput within 20 % [^:]*: "
                        r"(\d+ of \d+) cells(.*)$", md, re.M)
    fixed = re.findall(r"^- (local|ray): per-request, clocked at the search points' served step speeds: "
                       r"P50 within 15 %: (\d+ of \d+); P90 within 25 %: (\d+ of \d+)", md, re.M)
    return {"rc-ratio": ", ".join(spans), "rc-inside": f"{inside} of {len(cells)}",
            "rc-srv-within": ", ".join(w for w, _ in served) or "not measured",
            "rc-srv-tau": ", ".join(f"{w} {t}" for _, rest in served
                                    for w, t in re.findall(r"([a-z-]+) ([\d.-]+) over", rest)) or "not measured",
            "rc-srv-p50": ", ".join(f"{ex} {a}" for ex, a, _ in fixed) or "not measured",
            "rc-srv-p90": ", ".join(f"{ex} {b}" for ex, _, b in fixed) or "not measured",
            "rc-within": ", ".join(within) or "not measured", "rc-tau": ", ".join(taus) or "not measured",
            "rc-p50": ", ".join(f"{ex} {a}" for ex, a, _ in p50) or "not measured",
            "rc-p90": ", ".join(f"{ex} {b}" for ex, _, b in p50) or "not measured",
            "rc-loro-p50": ", ".join(f"{ex} {a}" for ex, a, _ in loro) or "not measured",
            "rc-loro-p90": ", ".join(f"{ex} {b}" for ex, _, b in loro) or "not measured"}


def _scale(md: str) -> dict[str, str]:
    """The issue-31 targets of benchmarks/results/sim_scaling.md: the CPU cost of 256 instances
    over 8, and each policy's 1 M-request run on 1,000 instances (measured or extrapolated)."""
    ratios = [float(x) for x in re.findall(r"^\| [a-z-]+: 19,366 req on 256 instances .*?\(CPU x([\d.]+)\)", md, re.M)]
    big = re.findall(r"^\| ([a-z-]+): 1 M req on 1,000 instances <= [\d,]+ s \| CPU ([\d,]+) s, wall [\d,]+ s "
                     r"\((measured|EXTRAPOLATED)[^|]*?peak RSS ([\d.]+) GiB[^|]*\| (yes|no) \(CPU\) \|", md, re.M)
    if not ratios or not big:
        raise ValueError("scaling report: no targets table")
    runs = ", ".join(f"`{p}` {cpu} s" + ("" if how == "measured" else " (extrapolated)") for p, cpu, how, _, _ in big)
    measured = [float(rss) for _, _, how, rss, _ in big if how == "measured"]
    missed = [p for p, _, _, _, ok in big if ok != "yes"]
    return {"scale-256": f"{min(ratios):.2f}–{max(ratios):.2f}×", "scale-1m": runs,
            "scale-1m-rss": f"{min(measured):.1f}–{max(measured):.1f} GiB" if measured else "not measured",
            "scale-1m-met": "met for all " + str(len(big)) if not missed else "not met for " + ", ".join(missed)}


def _gpu_steps(md: str) -> dict[str, str]:
    """The held-out error over every step of a docs/results/gpu_steps_*.md report."""
    row = re.search(r"^\| all \| \d+ \| ([\d.]+ %) \| ([\d.]+ %) \|", md, re.M)
    if not row:
        raise ValueError("GPU steps report: no 'all' row")
    return {"median": row.group(1), "max": row.group(2)}


GPU_STEPS = {"h100": "gs-h100-", "h200": "gs-h200-", "h100_qwen2.5-32b": "gs-32b-",
             "h100_qwen3-30b-a3b": "gs-moe-h100-", "h200_qwen3-30b-a3b": "gs-moe-h200-",
             **{f"h200_llama-3-{m}_tp{t}": f"gs-{m}-tp{t}-" for m, t in
                (("70b", 2), ("70b", 4), ("70b", 8), ("8b", 4), ("8b", 8))}}

# report (its path in the checkout) -> (its parser, the prefix its numbers' names get in the README)
SOURCES: dict[str, tuple[Callable[[str], dict[str, str]], str]] = {
    "benchmarks/results/sim_scaling.md": (_scale, ""),
    "docs/results/fidelity_published.md": (_fidelity, ""), "docs/results/real_cluster.md": (_real_cluster, ""),
    # as Ray actors (in one process: the line above)
    "docs/results/real_cluster_ray.md": (_real_cluster, "ray-"),
    "docs/results/real_cluster_ray_conv_mixed.md": (_real_cluster, "ray-mixed-"),
    # 64 requests a point (24 squeeze a trace's arrivals into one burst): conv-mixed, then conv-short
    "docs/results/real_cluster_64.md": (_real_cluster, "c64-"),
    "docs/results/real_cluster_64_ray.md": (_real_cluster, "c64-ray-"),
    "docs/results/real_cluster_64_short.md": (_real_cluster, "s64-"),
    "docs/results/real_cluster_64_short_ray.md": (_real_cluster, "s64-ray-"),
    # the third workload: BurstGPT's arrivals, prompts up to 1.5 k tokens
    "docs/results/real_cluster_burst.md": (_real_cluster, "burst-"),
    "docs/results/real_cluster_burst_ray.md": (_real_cluster, "burst-ray-"),
    # another host: a Zen 3 EPYC without bfloat16 (the engine runs float32 there)
    "docs/results/real_cluster_conv_mixed_zen3.md": (_real_cluster, "zen3-"),
    # the same host and workload again, all seven on one day with the speed checks split by kind
    "docs/results/real_cluster_conv_mixed_zen3_sameday.md": (_real_cluster, "zen3-day-"),
    # ... its fixed-rate points measured again, the machine checked before and after each (--refix)
    "docs/results/real_cluster_conv_mixed_zen3_refix.md": (_real_cluster, "zen3-refix-"),
    # ... and again, each served three times and the runs' requests pooled (--fixed-repeats 3)
    "docs/results/real_cluster_conv_mixed_zen3_repeats.md": (_real_cluster, "zen3-rep-"),
    # ... and again, each run on a fresh server with a timeline, also clocked from served steps
    "docs/results/real_cluster_conv_mixed_zen3_observed.md": (_real_cluster, "zen3-obs-"),
    # ... and all seven again, every real point on a timeline server, clocked by served steps
    "docs/results/real_cluster_conv_mixed_zen3_clocked.md": (_real_cluster, "zen3-clk-"),
    # ... and all seven again after the sampler drew a step's sampled rows in one batch
    "docs/results/real_cluster_conv_mixed_zen3_sampler.md": (_real_cluster, "zen3-smp-"),
    # whole steps timed on one GPU and priced, never fitted on (one rank of a TP group: *_tpN)
    **{f"docs/results/gpu_steps_{k}.md": (_gpu_steps, v) for k, v in GPU_STEPS.items()}}


def values(results: Path) -> dict[str, str]:
    """Every generated README number, from the reports of the checkout whose docs/results is
    `results`."""
    root = results.parents[1]
    out: dict[str, str] = {}
    for name, (parse, prefix) in SOURCES.items():
        out.update({prefix + k: v for k, v in parse((root / name).read_text()).items()})
    return out


def fill(readme: str, vals: dict[str, str]) -> str:
    """`readme` with each marked number replaced; a marker with no value is an error."""
    missing = sorted({m.group(1) for m in MARK.finditer(readme)} - vals.keys())
    if missing:
        raise ValueError(f"README marks numbers no report gives: {', '.join(missing)}")
    return MARK.sub(lambda m: f"<!-- gen:{m.group(1)} -->{vals[m.group(1)]}<!-- /gen:{m.group(1)} -->", readme)
