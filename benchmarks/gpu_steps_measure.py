"""Time whole serving steps of a Llama-shaped model on one GPU: prefill, decode and mixed steps.

Why: the simulator prices a step that mixes prompt chunks of different lengths with decodes as a
sum of parts, and its step-level GPU points are A100 ones. This script measures such steps on
an H100-class GPU so the cost model can be checked on data it was never fitted to
(`benchmarks/gpu_steps_compare.py` prices the same shapes and writes the report).

It needs only PyTorch (it runs on the lent GPU machine, where flowyard's own dependencies are
not installed). Weights are random bf16 tensors of the model's shapes; time does not depend on
their values. Each step runs every layer as an engine does: RMSNorm, fused QKV GEMM, rotary
embedding, a KV-cache write, attention (PyTorch's fused SDPA: flash for the causal prompt
chunks, one call per prompt as an eager engine does; one batched call for the decodes, all at
the same context), output GEMM, RMSNorm, fused gate/up GEMM, SiLU-and-multiply, down GEMM;
then the final norm and the LM head on one row per sequence. Each shape is timed twice:
eager (kernels launched from Python, as a 2023 engine does) and replayed from a CUDA graph (as
vLLM v1 and SGLang do), whose time is the GPU's alone.

    python benchmarks/gpu_steps_measure.py --out gpu_steps.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


@dataclass(frozen=True)
class Shape:
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256


LLAMA3_8B = Shape()
TINY = Shape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=1000)


def cases() -> list[dict]:
    """The steps to time: prefills [(history, new)], decodes [(count, context)]."""
    out = []
    for p in (128, 512, 1024, 2048, 4096, 8192):
        out.append({"prefills": [[0, p]], "decodes": []})
    for b in (1, 8, 32, 64, 128, 256):
        out.append({"prefills": [], "decodes": [[b, 1024]]})
    for c in (256, 4096, 8192):
        out.append({"prefills": [], "decodes": [[32, c]]})
    out.append({"prefills": [], "decodes": [[128, 4096]]})
    for p in (128, 512, 1024, 2048):
        for b in (16, 64):
            out.append({"prefills": [[0, p]], "decodes": [[b, 1024]]})
    out.append({"prefills": [[0, 512]], "decodes": [[64, 4096]]})
    # Same token count, different composition (PLA-Serve's premise: short prompts batched apart
    # from long ones).
    for k, n in ((8, 128), (4, 256), (2, 512)):
        out.append({"prefills": [[0, n]] * k, "decodes": []})
        out.append({"prefills": [[0, n]] * k, "decodes": [[32, 1024]]})
    out.append({"prefills": [[0, 1792], [0, 256]], "decodes": []})
    out.append({"prefills": [[0, 64]] * 32, "decodes": []})
    # Chunked prefill: a chunk of a long prompt whose earlier chunks are in the KV cache.
    for h, n in ((2048, 512), (8192, 512), (4096, 2048)):
        out.append({"prefills": [[h, n]], "decodes": []})
    out.append({"prefills": [[4096, 512]], "decodes": [[32, 1024]]})
    return out


class Model:
    def __init__(self, s: Shape, device: str, dtype: torch.dtype) -> None:
        self.s, self.device, self.dtype = s, device, dtype
        g = torch.Generator(device=device).manual_seed(0)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=dtype, generator=g) * 0.02

        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.layers = [dict(n1=torch.ones(s.hidden, device=device, dtype=dtype),
                            qkv=w(qkv, s.hidden), o=w(s.hidden, s.heads * s.head_dim),
                            n2=torch.ones(s.hidden, device=device, dtype=dtype),
                            gu=w(2 * s.intermediate, s.hidden), down=w(s.hidden, s.intermediate))
                       for _ in range(s.layers)]
        self.norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.lm = w(s.vocab, s.hidden)

    def kv(self, seqs: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode KV buffer (seqs, kv_heads, ctx, head_dim), shared by every layer: each layer
        still streams it from HBM (it is far larger than L2), and the GPU's memory holds the
        largest batches."""
        s = self.s
        k = torch.randn(seqs, s.kv_heads, ctx, s.head_dim, device=self.device, dtype=self.dtype)
        return k, k.clone()


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def make_step(m: Model, prefills: list[list[int]], decodes: list[list[int]]):
    """A closure running one step of this composition on preallocated inputs."""
    s = m.s
    lens = [n for _, n in prefills]
    nd, ctx = (decodes[0] if decodes else (0, 0))
    T = sum(lens) + nd
    x0 = torch.randn(T, s.hidden, device=m.device, dtype=m.dtype)
    half = s.head_dim // 2
    ang = torch.rand(T, 1, half, device=m.device, dtype=torch.float32)
    cos, sin = ang.cos().to(m.dtype), ang.sin().to(m.dtype)
    kc, vc = m.kv(nd, ctx) if nd else (None, None)
    # Each prompt chunk's cached history (keys and values of its earlier chunks).
    hist = [m.kv(1, h) if h else None for h, _ in prefills]
    gqa_mask = {"ok": True}  # does SDPA take GQA with a lower-right mask here?
    rows = torch.tensor([sum(lens[:i + 1]) - 1 for i in range(len(lens))]
                        + list(range(sum(lens), T)), device=m.device, dtype=torch.long)
    gq = s.heads // s.kv_heads
    q_sz, kv_sz = s.heads * s.head_dim, s.kv_heads * s.head_dim

    def step() -> torch.Tensor:
        x = x0
        for L in m.layers:
            h = rms(x, L["n1"])
            qkv = h @ L["qkv"].t()
            q, k, v = qkv.split((q_sz, kv_sz, kv_sz), dim=-1)
            q = rope(q.view(T, s.heads, s.head_dim), cos, sin)
            k = rope(k.view(T, s.kv_heads, s.head_dim), cos, sin)
            v = v.view(T, s.kv_heads, s.head_dim)
            outs, off = [], 0
            for n, hv in zip(lens, hist):  # one causal call per prompt chunk
                qs = q[off:off + n].transpose(0, 1).unsqueeze(0)
                ks = k[off:off + n].transpose(0, 1).unsqueeze(0)
                vs = v[off:off + n].transpose(0, 1).unsqueeze(0)
                if hv is None:
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gq > 1)
                else:  # the chunk's queries sit at the end of its keys: lower-right causal
                    ks, vs = torch.cat((hv[0], ks), dim=2), torch.cat((hv[1], vs), dim=2)
                    mask = causal_lower_right(n, ks.shape[2])
                    o = None
                    if gqa_mask["ok"]:
                        try:
                            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gq > 1)
                        except RuntimeError:  # found in the eager warm-up, before any capture
                            gqa_mask["ok"] = False
                    if o is None:
                        ks, vs = ks.repeat_interleave(gq, 1), vs.repeat_interleave(gq, 1)
                        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
                outs.append(o.squeeze(0).transpose(0, 1).reshape(n, q_sz))
                off += n
            if nd:
                kc[:, :, ctx - 1] = k[off:]  # the new token's KV into the cache
                vc[:, :, ctx - 1] = v[off:]
                qd = q[off:].unsqueeze(2)  # (nd, heads, 1, d)
                o = F.scaled_dot_product_attention(qd, kc, vc, enable_gqa=gq > 1)
                outs.append(o.reshape(nd, q_sz))
            a = torch.cat(outs) if len(outs) > 1 else outs[0]
            x = x + a @ L["o"].t()
            h = rms(x, L["n2"])
            gu = h @ L["gu"].t()
            g, u = gu.chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ L["down"].t()
        return rms(x.index_select(0, rows), m.norm) @ m.lm.t()

    step.gqa_mask = gqa_mask  # type: ignore[attr-defined]
    return step


def timed(fn, reps: int, sync) -> float:
    """Median seconds of `reps` calls, each synchronised."""
    ts = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


def measure(case: dict, m: Model, reps: int, graphs: bool) -> dict:
    cuda = m.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step = make_step(m, case["prefills"], case["decodes"])
    with torch.inference_mode():
        for _ in range(3):
            step()
        eager = timed(step, reps, sync)
        graph = None
        if graphs and cuda:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            for _ in range(3):
                g.replay()
            graph = timed(g.replay, reps, sync)
            del g
    if cuda:
        torch.cuda.empty_cache()
    out = {**case, "eager_ms": 1e3 * eager, "graph_ms": None if graph is None else 1e3 * graph}
    if any(h for h, _ in case["prefills"]):
        out["history_attention"] = "sdpa-gqa-mask" if step.gqa_mask["ok"] else "sdpa-repeated-kv"
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (a smoke test)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rev", default="", help="the flowyard revision this script is at (recorded)")
    a = ap.parse_args(argv)
    device = "cpu" if a.tiny or not torch.cuda.is_available() else "cuda"
    shape = TINY if a.tiny else LLAMA3_8B
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    m = Model(shape, device, dtype)
    todo = cases() if not a.tiny else cases()[:3] + cases()[-4:]
    t0, rows = time.time(), []
    for c in todo:
        if a.tiny:
            c = {"prefills": [[h, min(n, 64)] for h, n in c["prefills"]],
                 "decodes": [[min(b, 4), min(x, 64)] for b, x in c["decodes"]]}
        try:
            r = measure(c, m, a.reps, graphs=True)
        except Exception as e:  # one shape a backend cannot run is reported, not fatal
            print(f"skipped {c}: {type(e).__name__}: {e}", flush=True)
            continue
        rows.append(r)
        print(json.dumps(r), flush=True)
    meta = {"revision": a.rev, "model": "llama-3-8b" if not a.tiny else "tiny", "shape": shape.__dict__,
            "dtype": str(dtype), "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
            "torch": torch.__version__, "reps": a.reps, "wall_s": round(time.time() - t0, 1),
            "sdpa_backends": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                              "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled()}}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "points": rows}, f, indent=1)
    print(f"wrote {a.out}: {len(rows)} steps in {meta['wall_s']} s")


if __name__ == "__main__":
    main()
