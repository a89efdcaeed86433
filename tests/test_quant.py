"""Weight-only int8/int4 linears (flowyard/engine/quant.py): the kernels multiply by the weights
they claim to, the engine uses them where they pay, bad settings fail clearly, and the
quantised embedded model's greedy tokens stay close to bfloat16's, judged the way vLLM's tests
judge a quantised model (tokens equal, or where they first differ each side's token is among
the other's top-5)."""

from __future__ import annotations

import pytest
import torch

from flowyard.engine.attention import AttentionBatch, PrefillSeq
from flowyard.engine.embedded import embedded_model_path
from flowyard.engine.llm_engine import EngineConfig, LLMEngine
from flowyard.engine.loader import load_checkpoint
from flowyard.engine.model import CausalLM
from flowyard.engine.quant import QuantizedLinear, QuantWeight, quantize_model
from flowyard.engine.sampling import SamplingParams

MODES = ["int8", "int4"]


# -- kernels ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_multiplies_by_its_dequantised_weight(mode, dtype):
    torch.manual_seed(0)
    w = (torch.randn(96, 128) * 0.05).to(dtype)
    before = w.clone()
    qw, deq = QuantWeight.make(w, mode)
    assert torch.equal(w, before)  # the source weight is not touched
    for rows in (1, 5, 32):
        x = torch.randn(rows, 128).to(dtype)
        ref = x.float() @ deq.t()
        got = qw(x)
        assert got.dtype == dtype
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bfloat16: the output's own rounding
        assert (got.float() - ref).abs().max() <= tol * ref.abs().max()
    # the quantised weight is close to the original: within half a step of its grid
    err = (deq - w.float()).abs().max() / w.float().abs().max()
    assert err < (0.01 if mode == "int8" else 0.1), err


def test_int4_reproduces_4bit_group_weights_exactly():
    """Weights that already are 4-bit codes per group of 32 (as the embedded Q4_1 GGUF's are)
    come back unchanged from float32: requantising them loses nothing."""
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (64, 4, 32)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # every group spans the full range, as Q4_1 does
    w = (codes * torch.rand(64, 4, 1) * 0.01 - torch.rand(64, 4, 1) * 0.05).reshape(64, 128)
    _, deq = QuantWeight.make(w, "int4")
    assert torch.allclose(deq, w, atol=1e-7)


# -- the engine's use of them ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from helpers_models import make_tiny_model

    d, _ = make_tiny_model(tmp_path_factory.mktemp("q"), "qwen2")  # qkv biases: the bias path
    return d


def _tiny_model(d) -> tuple[CausalLM, object]:
    ckpt = load_checkpoint(d)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    return model, ckpt.tokenizer


@pytest.mark.parametrize("mode", MODES)
def test_engine_routes_small_batches_to_the_quantised_kernel(tiny_dir, mode):
    model, tok = _tiny_model(tiny_dir)
    engine = LLMEngine(model, tok, EngineConfig(dtype="bfloat16", quantization=mode))
    linear = engine.model.linear
    assert isinstance(linear, QuantizedLinear) and linear.mode == mode
    layer = engine.model.layers[0]
    qw = linear.lookup(layer.qkv.weight)
    assert qw is not None and linear.lookup(engine.model.embed.weight) is None  # lm_head stays bf16
    # the layer weights were replaced by their dequantised values: both paths agree
    x = torch.randn(3, layer.qkv.weight.shape[1]).bfloat16()
    small = linear(x, layer.qkv.weight, layer.qkv.bias)
    large = linear(x.repeat(linear.max_rows, 1), layer.qkv.weight, layer.qkv.bias)[:3]
    assert torch.allclose(small.float(), large.float(), atol=2e-2, rtol=2e-2)
    calls = []
    orig = QuantWeight.__call__
    QuantWeight.__call__ = lambda self, x: calls.append(x.shape[0]) or orig(self, x)
    try:
        out = engine.generate([[5, 17, 99, 3], [30, 31]], SamplingParams(max_tokens=4, temperature=0,
                                                                          ignore_eos=True))
    finally:
        QuantWeight.__call__ = orig
    assert all(len(o.new_token_ids) == 4 for o in out)
    assert calls and max(calls) <= linear.max_rows
    # a second engine on the same model (as a LocalCluster builds) reuses the quantised copies
    again = LLMEngine(engine.model, tok, EngineConfig(dtype="bfloat16", quantization=mode))
    assert again.model.linear.lookup(layer.qkv.weight) is qw


def test_bad_quantization_settings_fail_clearly(tiny_dir):
    for bad in ("int3", "INT8", "fp8", ""):
        with pytest.raises(ValueError, match="quantization must be one of int8, int4"):
            EngineConfig(quantization=bad)
    model, tok = _tiny_model(tiny_dir)
    LLMEngine(model, tok, EngineConfig(dtype="bfloat16", quantization="int4"))
    for other in ("int8", None):  # its original weights are gone
        with pytest.raises(ValueError, match="quantised to int4 in place"):
            LLMEngine(model, tok, EngineConfig(dtype="bfloat16", quantization=other))
    with pytest.raises(ValueError):
        quantize_model(model, "int2")

    from flowyard.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--quantization", "int4"]).quantization == "int4"
    assert parser.parse_args(["serve"]).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "int3"])


# -- quality on the embedded model ------------------------------------------------------------------

CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
         "Translate 'good morning' into Spanish."]
N_TOKENS = 24


@pytest.fixture(scope="module")
def smol():
    ckpt = load_checkpoint(embedded_model_path())
    tok = ckpt.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in CHATS]

    def engine(mode):
        model = CausalLM(ckpt.config)
        model.load_weights(dict(ckpt.weights))  # a fresh copy each: quantisation is in place
        return LLMEngine(model, tok, EngineConfig(dtype="bfloat16", quantization=mode, enable_prefix_caching=False))

    ref = engine(None)
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
    return engine, ref, [o.new_token_ids for o in ref.generate(prompts, params)], prompts, params


def _top5(engine: LLMEngine, seq: list[int]) -> list[int]:
    """The model's 5 most likely next tokens after `seq` (one prefill on a scratch cache)."""
    n = len(seq)
    blocks = -(-n // engine.kv.block_size)
    batch = AttentionBatch(slot_mapping=torch.arange(n), sample_rows=torch.tensor([n - 1]),
                           prefills=[PrefillSeq(0, n, 0, torch.arange(blocks))], num_prefill_tokens=n)
    logits = engine.runner.model(torch.tensor(seq), torch.arange(n), batch, torch.zeros_like(engine.runner.kv_cache))
    return logits[0].topk(5).indices.tolist()


@pytest.mark.parametrize("mode", MODES)
def test_quantised_greedy_tokens_close_to_bfloat16(smol, mode):
    engine, ref_engine, ref_tokens, prompts, params = smol
    quant = engine(mode)
    got = [o.new_token_ids for o in quant.generate(prompts, params)]
    agreed = []
    for prompt, a, b in zip(prompts, ref_tokens, got):
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        agreed.append(len(a) if i is None else i)
        if i is None:
            continue
        ref_top, got_top = _top5(ref_engine, prompt + a[:i]), _top5(quant, prompt + b[:i])
        assert b[i] in ref_top, f"{mode} token {i}: {b[i]} not in bf16's top-5 {ref_top}"
        assert a[i] in got_top, f"{mode} token {i}: bf16's {a[i]} not in the quantised top-5 {got_top}"
    assert sum(agreed) > 0, agreed  # not all diverging at the first token
