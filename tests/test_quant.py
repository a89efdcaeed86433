"""Quantised linears (flowyard/engine/quant.py; weight-only int8/int4, and W8A8): the kernels
multiply by the weights they claim to, the engine uses them where they pay, bad settings fail clearly, and the
quantised embedded model's greedy tokens stay close to bfloat16's, judged the way vLLM's tests
judge a quantised model (tests/helpers_close.py: tokens equal, or where they first differ each
side's token is among the other's top-5 log-probabilities, as each engine reported them)."""

from __future__ import annotations

import pytest
import torch

from flowyard.engine.embedded import embedded_model_path
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.loader import load_checkpoint
from flowyard.engine.model import CausalLM
from flowyard.engine.quant import W8A8_MIN_ROWS, QuantizedLinear, QuantWeight, quantize_model, w8a8_linear
from flowyard.engine.sampling import SamplingParams
from helpers_close import check_greedy_close

MODES = ["int8", "int4", "w8a8"]


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
        if mode == "w8a8" and rows >= W8A8_MIN_ROWS:  # what it multiplies is x rounded per row
            sx = x.float().abs().amax(dim=1, keepdim=True) / 127
            x_used = (x.float() / sx).round() * sx
        else:
            x_used = x.float()
        ref = x_used @ deq.t()
        got = qw(x)
        assert got.dtype == dtype
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bfloat16: the output's own rounding
        assert (got.float() - ref).abs().max() <= tol * ref.abs().max()
    # the quantised weight is close to the original: within half a step of its grid
    err = (deq - w.float()).abs().max() / w.float().abs().max()
    assert err < (0.1 if mode == "int4" else 0.01), err


def test_w8a8_scales_each_row_by_its_own_maximum():
    """One outlier row must not coarsen the others (per-token, not per-tensor, activation
    scales), and an all-zero row stays zero instead of dividing by zero."""
    torch.manual_seed(2)
    w = torch.randn(64, 96) * 0.05
    qw, deq = QuantWeight.make(w, "w8a8")
    x = torch.randn(8, 96)
    x[3] *= 1000  # an outlier token
    x[5] = 0
    before = x.clone()
    got = w8a8_linear(x, qw.q, qw.scale)
    assert torch.equal(x, before)  # float32 input: quantised in a copy, not in place
    ref = x @ deq.t()
    rel = ((got - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-30))
    assert rel[[0, 1, 2, 4, 6, 7]].max() < 0.02 and rel[3] < 0.02, rel
    assert torch.equal(got[5], torch.zeros(64))


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
    large = linear(x.repeat(min(linear.max_rows, 4), 1), layer.qkv.weight, layer.qkv.bias)[:3]
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
    if mode == "w8a8":  # the 6-token prefill too
        assert max(calls) >= W8A8_MIN_ROWS
    # a second engine on the same model (as a LocalCluster builds) reuses the quantised copies
    again = LLMEngine(engine.model, tok, EngineConfig(dtype="bfloat16", quantization=mode))
    assert again.model.linear.lookup(layer.qkv.weight) is qw


def test_bad_quantization_settings_fail_clearly(tiny_dir):
    for bad in ("int3", "INT8", "fp8", ""):
        with pytest.raises(ValueError, match="quantization must be one of int8, int4, w8a8"):
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
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True, logprobs=5)

    def run(mode):
        """Greedy tokens and each step's top-5 log-probabilities of a fresh bf16 engine."""
        model = CausalLM(ckpt.config)
        model.load_weights(dict(ckpt.weights))  # a fresh copy each: quantisation is in place
        engine = LLMEngine(model, tok, EngineConfig(dtype="bfloat16", quantization=mode))
        return [(o.new_token_ids, o.logprobs) for o in engine.generate(prompts, params)]

    return run, run(None)


@pytest.mark.parametrize("mode", MODES)
def test_quantised_greedy_tokens_close_to_bfloat16(smol, mode):
    run, ref = smol
    agreed = [check_greedy_close(r, q, k=5) for r, q in zip(ref, run(mode))]
    assert sum(agreed) > 0, agreed  # not every prompt parting at its first token
