"""The markdown report of benchmarks/serving_vs_vllm.py: the table and issue 14's verdicts.

Every number comes from the client's saved result JSON of the run being reported; the verdicts
are computed from those numbers, never written by hand. A comparison against a zero is not
called met when both sides are zero: a check that passes on all-zero values checks nothing.
"""

from __future__ import annotations

INPUT_LEN, OUTPUT_LEN = 256, 64
GOODPUT = ("ttft:500", "tpot:100")  # ms, vLLM's --goodput syntax
VLLM = "vllm"

# (label, key in the client's result JSON); "higher" says which way is better
METRICS = (
    ("goodput (req/s)", "request_goodput", "higher"),
    ("request throughput (req/s)", "request_throughput", "higher"),
    ("output throughput (tok/s)", "output_throughput", "higher"),
    ("median TTFT (ms)", "median_ttft_ms", "lower"),
    ("p99 TTFT (ms)", "p99_ttft_ms", "lower"),
    ("median ITL (ms)", "median_itl_ms", "lower"),
    ("median TPOT (ms)", "median_tpot_ms", "lower"),
)

# Issue 14's serving targets: goodput >= 1.5x vLLM's at these rates; median ITL <= vLLM's.
GOODPUT_TARGET, GOODPUT_RATES = 1.5, (1.0, 2.0)


def fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"
    return str(v)


def ratio(ours, vllm) -> str:
    if ours is None or vllm is None or vllm == 0:
        return "—"
    return f"{ours / vllm:.2f}"


def render_table(rows: dict[tuple[str, float], dict], rates, servers: list[str]) -> str:
    """rows[(server, rate)] -> row_from_result(...); servers[0] is vLLM, each other one gets
    its value and its ratio to vLLM. One line per (rate, metric)."""
    ours = [s for s in servers if s != VLLM]
    head = "| rate (req/s) | metric | vLLM | " + " | ".join(f"{s} | {s} / vLLM" for s in ours) + " | better |"
    out = [head, "|---:|---|---:|" + "---:|---:|" * len(ours) + "---|"]

    def line(label: str, cells: list[str]) -> str:
        return "| " + " | ".join([f"{rate:g}", label, *cells]) + " |"

    def facts(label: str, cell) -> str:  # a fact per server: no ratio, no direction
        vals = [cell(rows.get((s, rate))) for s in [VLLM, *ours]]
        return line(label, [vals[0], *[c for v in vals[1:] for c in (v, "")], ""])

    for rate in rates:
        out.append(facts("completed / sent", lambda r: f"{r['completed']}/{r['num_prompts']}" if r else "—"))
        out.append(facts("input / output tokens (server-counted)",
                         lambda r: f"{r['total_input_tokens']} / {r['total_output_tokens']}" if r else "—"))
        out.append(facts("benchmark duration (s)", lambda r: fmt(r["duration"]) if r else "—"))
        out.append(facts("ITL samples per request (median)", lambda r: fmt(r["itl_samples"]) if r else "—"))
        for label, key, better in METRICS:
            v = (rows.get((VLLM, rate)) or {}).get(key)
            xs = [(rows.get((s, rate)) or {}).get(key) for s in ours]
            out.append(line(label, [fmt(v), *[c for x in xs for c in (fmt(x), ratio(x, v))], better]))
    return "\n".join(out)


def verdicts(rows: dict[tuple[str, float], dict], rates, servers: list[str]) -> list[str]:
    """One line per flowyard server and target, computed from the rows."""
    lines = []
    for s in (x for x in servers if x != VLLM):
        parts = []
        for rate in (r for r in GOODPUT_RATES if r in rates):
            v, f = rows.get((VLLM, rate)), rows.get((s, rate))
            if v is None or f is None:
                parts.append(f"{rate:g} req/s: not measured")
                continue
            gv, gf = v["request_goodput"], f["request_goodput"]
            if gv == 0 and gf == 0:
                parts.append(f"{rate:g} req/s: not met (both 0)")
            elif gv == 0:
                parts.append(f"{rate:g} req/s: met ({fmt(gf)} against vLLM's 0)")
            else:
                ok = gf >= GOODPUT_TARGET * gv
                parts.append(f"{rate:g} req/s: {'met' if ok else 'not met'} ({gf / gv:.2f}x)")
        lines.append(f"{s}: goodput ≥ {GOODPUT_TARGET:g}x vLLM's — " + "; ".join(parts) + ".")
        itl = []
        for rate in rates:
            v, f = rows.get((VLLM, rate)), rows.get((s, rate))
            if v is None or f is None or not v["median_itl_ms"] or not f["median_itl_ms"]:
                continue
            ok = f["median_itl_ms"] <= v["median_itl_ms"]
            itl.append(f"{rate:g} req/s {'met' if ok else 'not met'} ({fmt(f['median_itl_ms'])} against "
                       f"{fmt(v['median_itl_ms'])} ms)")
        lines.append(f"{s}: median ITL ≤ vLLM's — " + ("; ".join(itl) if itl else "not measured") + ".")
    return lines


def render_markdown(*, rows, rates, servers: list[str], quick: bool, command: str, date: str, revision: str,
                    machine_desc: str, versions: dict[str, dict[str, str]], server_cmds: dict[str, str],
                    vllm_env: dict[str, str], client_example: str, result_dir: str,
                    num_prompts: dict[float, int], notes: list[str]) -> str:
    vv = ", ".join(f"{k} {v}" for k, v in versions.get("vllm", {}).items())
    fv = ", ".join(f"{k} {v}" for k, v in versions.get("flowyard", {}).items())
    ours = [s for s in servers if s != VLLM]
    lines = [
        "# Serving: flowyard against vLLM's CPU build (vLLM's own benchmark client)",
        "",
        *(["**Quick smoke run** (a few prompts per rate): the numbers say the pipeline works, not how fast "
           "anything is.", ""] if quick else []),
        f"Date: {date}. Machine: {machine_desc}; no GPU. The cores are shared: the servers and the "
        "benchmark client run on them, one server at a time, and other work on the machine may have "
        "run too, so figures vary from run to run.",
        "",
        f"flowyard measured at git revision {revision}.",
        "",
        f"Versions: vLLM side: {vv or 'unknown'}. flowyard side: {fv or 'unknown'}.",
        "",
        f"Command: `{command}`",
        "",
        f"Workload: `vllm bench serve`, random dataset, {INPUT_LEN} input / {OUTPUT_LEN} output tokens "
        "(`--ignore-eos`, so every request decodes all of them; `--temperature 0`, greedy on all), Poisson "
        "arrivals at each rate, "
        "prompts per rate " + ", ".join(f"{n} at {r:g}/s" for r, n in num_prompts.items()) +
        "; the same seed per rate for every server, so all get the same prompts (a new seed at each "
        f"rate, so no rate hits the prefix cache of the previous one). Goodput counts the requests with "
        f"TTFT ≤ {GOODPUT[0].split(':')[1]} ms and TPOT ≤ {GOODPUT[1].split(':')[1]} ms.",
        "",
        f"Every number below is read from the client's saved result JSON of this run ({result_dir}); "
        "ratios are flowyard / vLLM.",
        "",
        render_table(rows, rates, servers),
        "",
        "Targets (issue 14), computed from the table above:",
        "",
        *[f"- {v}" for v in verdicts(rows, rates, servers)],
        "",
        "Servers (started one at a time, each serving all rates):",
        "",
        (f"- vLLM: `{' '.join(f'{k}={v}' for k, v in vllm_env.items())} {server_cmds[VLLM]}`"
         if VLLM in server_cmds else "- vLLM: not run"),
        *[f"- {s}: `{server_cmds[s]}`" for s in ours if s in server_cmds],
        "",
        "Every flowyard server loads the embedded GGUF, dequantised to bfloat16 at load: the same "
        "weights as the HF directory vLLM loads (`--quantization` then requantises them in memory).",
        "",
        f"Client, e.g.: `vllm {client_example}`",
        "",
    ]
    if notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)
