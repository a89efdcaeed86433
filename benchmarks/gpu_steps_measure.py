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

    python benchmarks/gpu_steps_measure.py --out gpu_steps.json [--model qwen3-30b-a3b] [--tp 4]

`--model` takes a dense shape (Llama-3-8B, Llama-3-70B, Qwen2.5-32B) or the MoE Qwen3-30B-A3B,
whose experts run as fused-MoE engines run them: tokens sorted by expert, two grouped GEMMs.
`--tp N` times one rank of an N-way tensor-parallel group (Megatron's split: heads, KV heads,
the MLP's width and the vocabulary divided by N) with no collectives: one GPU cannot run an
all-reduce, so this separates a TP step's compute from its communication, which the cost
model prices as separate terms.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass, replace

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
    experts: int = 0  # > 0: every layer's MLP is `experts` SwiGLU experts of width expert_intermediate
    experts_active: int = 0  # top-k
    expert_intermediate: int = 0

    def shard(self, tp: int) -> "Shape":
        """One rank's slice of a `tp`-way tensor-parallel group; KV heads are replicated when
        there are fewer than ranks (as vLLM does), so a rank keeps at least one."""
        if tp < 1 or self.heads % tp or (self.intermediate or self.expert_intermediate) % tp or self.vocab % tp:
            raise ValueError(f"--tp {tp} does not divide this model's heads, MLP width and vocabulary")
        return replace(self, heads=self.heads // tp, kv_heads=max(1, -(-self.kv_heads // tp)),
                       intermediate=self.intermediate // tp,
                       expert_intermediate=self.expert_intermediate // tp, vocab=self.vocab // tp)


LLAMA3_8B = Shape()
# The catalog's shapes (flowyard/costmodel/models.py; tests/test_gpu_steps.py keeps them equal).
SHAPES = {
    "llama-3-8b": LLAMA3_8B,
    "llama-3-70b": Shape(hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128, intermediate=28672,
                         vocab=128256),
    "qwen2.5-32b": Shape(hidden=5120, layers=64, heads=40, kv_heads=8, head_dim=128, intermediate=27648,
                         vocab=152064),
    "qwen3-30b-a3b": Shape(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, intermediate=0,
                           vocab=151936, experts=128, experts_active=8, expert_intermediate=768),
}
TINY = Shape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=1000)
TINY_MOE = Shape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=0, vocab=1000,
                 experts=8, experts_active=2, expert_intermediate=64)


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
        def mlp() -> dict:
            if not s.experts:
                return dict(gu=w(2 * s.intermediate, s.hidden), down=w(s.hidden, s.intermediate))
            # experts stored (E, out, in) and passed transposed, the layout grouped GEMMs take
            e, i = s.experts, s.expert_intermediate
            return dict(router=w(e, s.hidden), egu=w(e, 2 * i, s.hidden), edown=w(e, s.hidden, i))

        self.layers = [dict(n1=torch.ones(s.hidden, device=device, dtype=dtype),
                            qkv=w(qkv, s.hidden), o=w(s.hidden, s.heads * s.head_dim),
                            n2=torch.ones(s.hidden, device=device, dtype=dtype), **mlp())
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


def moe(h: torch.Tensor, L: dict, s: Shape) -> torch.Tensor:
    """An MoE MLP as fused-MoE engines run it, with no host synchronisation (so it replays from a
    CUDA graph): router GEMM, softmax top-k (renormalised, as Qwen3), the token copies sorted by
    expert, two grouped GEMMs over the experts' row groups (`torch._grouped_mm`, CUTLASS on
    Hopper), SwiGLU, and the weighted sum of each token's k outputs."""
    k, e = s.experts_active, s.experts
    probs = (h @ L["router"].t()).float().softmax(-1)
    wt, idx = probs.topk(k, dim=-1)
    wt = (wt / wt.sum(-1, keepdim=True)).to(h.dtype).reshape(-1)
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    src = order // k  # the token each sorted row copies
    counts = torch.zeros(e, device=h.device, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    gu = torch._grouped_mm(h.index_select(0, src), L["egu"].transpose(-2, -1), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, L["edown"].transpose(-2, -1), offs=offs)
    y = y * wt.index_select(0, order).unsqueeze(-1)
    return torch.zeros_like(h).index_add_(0, src, y)


def varlen_attention(lens: list[int], heads: int, kv_heads: int, device: str):
    """Attention over several prompts' (T, heads, d) rows as ONE causal variable-length
    flash-attention call, as vLLM's prefill makes it, across the keyword spellings PyTorch
    releases have used (causal as a window or a flag; GQA native or by repeated KV heads). The
    offsets are made here, outside any CUDA-graph capture."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], device=device, dtype=torch.int32)
    kw: dict = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = heads // kv_heads
    if gqa > 1 and "enable_gqa" in params:
        kw["enable_gqa"], gqa = True, 1
    mx = max(lens)

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if gqa > 1:
            k, v = k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1)
        return varlen_attn(q, k, v, cu, cu, mx, mx, **kw)
    return attn


def make_step(m: Model, prefills: list[list[int]], decodes: list[list[int]], varlen: bool = False):
    """A closure running one step of this composition on preallocated inputs; `varlen` runs the
    prompts' attention (several prompts, none with cached history) as one variable-length call
    instead of one call per prompt."""
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
    vl = varlen_attention(lens, s.heads, s.kv_heads, m.device) if varlen else None
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
            if vl is not None:
                p = sum(lens)
                outs.append(vl(q[:p], k[:p], v[:p]).reshape(p, q_sz))
                off = p
            for n, hv in zip(lens if vl is None else [], hist):  # one causal call per prompt chunk
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
            if s.experts:
                x = x + moe(h, L, s)
                continue
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


def graph_of(fn) -> "torch.cuda.CUDAGraph":
    """fn captured in a CUDA graph (run once on a side stream first, as capture requires)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def measure(case: dict, m: Model, reps: int, graphs: bool, varlen: bool = False) -> dict:
    cuda = m.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step = make_step(m, case["prefills"], case["decodes"], varlen)
    with torch.inference_mode():
        for _ in range(3):
            step()
        eager = timed(step, reps, sync)
        graph = None
        if graphs and cuda:
            try:
                g = graph_of(step)
            except Exception as e:  # a kernel that cannot be captured: eager time only
                print(f"no CUDA graph for {case}: {type(e).__name__}: {e}", flush=True)
            else:
                for _ in range(3):
                    g.replay()
                graph = timed(g.replay, reps, sync)
            del g
    if cuda:
        torch.cuda.empty_cache()
    out = {**case, "eager_ms": 1e3 * eager, "graph_ms": None if graph is None else 1e3 * graph}
    if varlen:
        out["attention"] = "varlen"
    if any(h for h, _ in case["prefills"]):
        out["history_attention"] = "sdpa-gqa-mask" if step.gqa_mask["ok"] else "sdpa-repeated-kv"
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--model", default="llama-3-8b", choices=sorted(SHAPES), help="a catalog model's shape")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (MoE if --model is) on the CPU (a smoke test)")
    ap.add_argument("--tp", type=int, default=1, help="time one rank of a TP group this wide (no collectives)")
    ap.add_argument("--varlen", action="store_true",
                    help="only the steps of several fresh prompts, their attention one variable-length call")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rev", default="", help="the flowyard revision this script is at (recorded)")
    a = ap.parse_args(argv)
    device = "cpu" if a.tiny or not torch.cuda.is_available() else "cuda"
    shape = SHAPES[a.model] if not a.tiny else (TINY_MOE if SHAPES[a.model].experts else TINY)
    try:
        shard = shape.shard(a.tp)
    except ValueError as e:
        ap.error(str(e))
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    m = Model(shard, device, dtype)
    todo = cases() if not a.tiny else cases()[:3] + cases()[-4:]
    if a.varlen:
        todo = [c for c in cases() if len(c["prefills"]) > 1 and not any(h for h, _ in c["prefills"])]
    t0, rows = time.time(), []
    for c in todo:
        if a.tiny:
            c = {"prefills": [[h, min(n, 64)] for h, n in c["prefills"]],
                 "decodes": [[min(b, 4), min(x, 64)] for b, x in c["decodes"]]}
        try:
            r = measure(c, m, a.reps, graphs=True, varlen=a.varlen)
        except Exception as e:  # one shape a backend cannot run is reported, not fatal
            print(f"skipped {c}: {type(e).__name__}: {e}", flush=True)
            continue
        rows.append(r)
        print(json.dumps(r), flush=True)
    meta = {"revision": a.rev, "model": a.model if not a.tiny else "tiny", "shape": shape.__dict__,
            "tp": a.tp, "shard": shard.__dict__,
            "dtype": str(dtype), "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
            "torch": torch.__version__, "reps": a.reps, "wall_s": round(time.time() - t0, 1),
            "sdpa_backends": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                              "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled()}}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "points": rows}, f, indent=1)
    print(f"wrote {a.out}: {len(rows)} steps in {meta['wall_s']} s")


if __name__ == "__main__":
    main()
