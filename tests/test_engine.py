"""The real engine against transformers, and its runner invariants (batching, chunking,
preemption, prefix caching, sampling, stop conditions, abort, KV export/import)."""

from __future__ import annotations

import pytest
import torch

from helpers_close import check_greedy_close, hf_greedy_logprobs
from helpers_models import make_tiny_model
from flowyard.engine.embedded import embedded_model_path
from flowyard.engine.engine_config import EngineConfig
from flowyard.engine.llm_engine import LLMEngine
from flowyard.engine.loader import load_checkpoint
from flowyard.engine.model import CausalLM, PackedLinear
from flowyard.engine.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 44, 120, 7], list(range(30, 71)), [200, 201]]


def build(path, **cfg) -> LLMEngine:
    ckpt = load_checkpoint(path)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    return LLMEngine(model, ckpt.tokenizer, EngineConfig(**{"dtype": "float32", **cfg}))  # as transformers


def hf_greedy(hf, prompt, n):
    """transformers' greedy tokens, not stopping at EOS (like ignore_eos)."""
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen2-tied"])
def tiny(request, tmp_path_factory):
    arch, _, tied = request.param.partition("-")
    d, _ = make_tiny_model(tmp_path_factory.mktemp("m"), arch, tied=bool(tied))
    hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    return d, hf


def test_greedy_tokens_and_logits_match_transformers(tiny):
    d, hf = tiny
    engine = build(d)
    outs = engine.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.new_token_ids == hf_greedy(hf, prompt, 24)
    logits = engine.runner.model(*_one_prefill(engine, PROMPTS[1]))
    ref = hf(torch.tensor([PROMPTS[1]])).logits[0, -1]
    assert torch.allclose(logits[0], ref, atol=1e-4), (logits[0] - ref).abs().max()


def _one_prefill(engine, prompt):
    """Inputs for a lone fresh prefill on a scratch cache (for a logits comparison)."""
    from flowyard.engine.attention import AttentionBatch, PrefillSeq

    n = len(prompt)
    blocks = -(-n // engine.kv.block_size)
    table = torch.arange(blocks)
    batch = AttentionBatch(slot_mapping=torch.arange(n), sample_rows=torch.tensor([n - 1]),
                           prefills=[PrefillSeq(0, n, 0, table)], num_prefill_tokens=n)
    return torch.tensor(prompt), torch.arange(n), batch, torch.zeros_like(engine.runner.kv_cache)


def test_tokens_do_not_depend_on_batching_chunking_or_preemption(tiny):
    d, _ = tiny
    alone = [build(d).generate([p], GREEDY)[0].new_token_ids for p in PROMPTS]
    together = [o.new_token_ids for o in build(d).generate(PROMPTS, GREEDY)]
    chunked = [o.new_token_ids for o in build(d, max_num_batched_tokens=7).generate(PROMPTS, GREEDY)]
    tight = build(d, kv_cache_tokens=96, block_size=8)  # forces recompute preemption
    preempted = [o.new_token_ids for o in tight.generate(PROMPTS, GREEDY)]
    assert alone == together == chunked == preempted
    assert any(s.preemptions for s in [*tight.scheduler.running]) or tight.kv.num_used_blocks == 0


def test_prefix_cache_reuses_history_and_keeps_tokens(tiny):
    d, _ = tiny
    engine = build(d, block_size=4)
    base = engine.generate([PROMPTS[1]], GREEDY)[0].new_token_ids
    again = engine.generate([PROMPTS[1]], GREEDY)[0].new_token_ids
    assert again == base and engine.kv.hits >= 36


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    d, _ = tiny
    p = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = build(d).generate([PROMPTS[0]], p)[0].new_token_ids
    mixed = build(d).generate([PROMPTS[0], PROMPTS[1]], [p, GREEDY])[0].new_token_ids
    other = build(d).generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.8, seed=8,
                                                          ignore_eos=True))[0].new_token_ids
    assert alone == mixed and alone != other
    top1 = build(d).generate([PROMPTS[0]], SamplingParams(max_tokens=24, top_k=1, ignore_eos=True))
    assert top1[0].new_token_ids == build(d).generate([PROMPTS[0]], GREEDY)[0].new_token_ids


def test_min_tokens_bans_eos_until_reached(tiny):
    d, _ = tiny
    engine = build(d)
    eos = engine.eos[0]
    p = SamplingParams(max_tokens=12, temperature=0, min_tokens=12, stop_token_ids=(eos,))
    out = engine.generate([PROMPTS[0]], p)[0]  # a regression: sampling edited inference tensors
    assert out.completion_tokens == 12 and eos not in out.new_token_ids


def test_stop_conditions_and_abort_free_kv(tiny):
    d, _ = tiny
    engine = build(d)
    full = engine.generate([PROMPTS[1]], GREEDY)[0]
    assert full.finish_reason == "length" and full.completion_tokens == 24
    stop = full.new_text[len(full.new_text) // 2:][:2]
    if stop.strip():
        cut = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0, stop=(stop,)))[0]
        assert cut.finish_reason == "stop" and stop not in cut.new_text
        assert full.new_text.startswith(cut.new_text)
    engine.add_request("x", PROMPTS[1], GREEDY)
    engine.step(), engine.step()
    assert engine.kv.num_used_blocks > 0
    assert engine.abort("x").finish_reason == "abort"
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished() and not engine.kv.leaked()
    assert engine.abort("unknown") is None


def test_warm_up_runs_a_prefill_past_the_small_gemv_rows_and_a_decode(tiny):
    """A regression: warm-up ran a 4-token prompt, which never leaves the small-GEMV kernel, so
    the first real prompt paid the GEMM path's one-time setup (a few times a decode step)."""
    from flowyard.engine.gemv_kernel import MAX_ROWS

    d, _ = tiny
    engine = build(d)
    shapes = []
    execute = engine.runner.execute
    engine.runner.execute = lambda plan: (shapes.append(plan.shape()), execute(plan))[1]
    engine.warm_up()
    assert max(int(s.prefill_tokens) for s in shapes) > MAX_ROWS
    assert any(int(s.decode_seqs) and not int(s.prefill_tokens) for s in shapes)
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished()


def test_an_engine_made_on_a_shared_model_keeps_its_packed_weights(tiny):
    """A regression: every LLMEngine cast its model with .to(dtype), which drops PackedLinear's
    oneDNN copies even at the same dtype, so each instance of a cluster repacked all weights
    on its first batched step (served as a first step several times too long)."""
    d, _ = tiny
    a = build(d, dtype="bfloat16")
    if not a.model.linear.available:
        pytest.skip("no oneDNN bfloat16 linear on this CPU")
    a.generate([PROMPTS[1]], GREEDY)
    packed = dict(a.model.linear._cache)
    assert packed
    LLMEngine(a.model, a.tokenizer, EngineConfig(dtype="bfloat16"), instance=1)
    assert a.model.linear._cache == packed


def test_kv_export_import_continues_on_another_engine(tiny):
    """A request moved mid-decode (KV by block range) continues with identical tokens."""
    d, _ = tiny
    ref = build(d).generate([PROMPTS[1]], GREEDY)[0].new_token_ids
    a, b = build(d), build(d)
    a.add_request("r", PROMPTS[1], GREEDY)
    for _ in range(6):
        a.step()
    st = a.tracked("r").state
    blocks = a.kv.block_table(st.id)
    data = a.runner.export_kv(blocks)
    b.add_request("r", PROMPTS[1], GREEDY)
    st_b = b.tracked("r").state
    b.scheduler.abort(st_b.id)  # replace the fresh copy by the migrated one
    st_b.num_computed, st_b.num_output = st.num_computed, st.num_output
    st_b.output_tokens, st_b.token_times = list(st.output_tokens), list(st.token_times)
    b.scheduler.add_migration(st_b, b.now())
    assert b.scheduler.admit_migrations(b.now()) == [st_b]
    b.runner.import_kv(b.kv.block_table(st_b.id)[: len(blocks)], data)
    b.scheduler.migration_arrived(st_b, b.now())
    b.tracked("r").emitted_tokens = st.num_output  # those were streamed by the first engine
    produced = list(st.output_tokens)
    while b.has_unfinished():
        for o in b.step():
            produced += o.new_token_ids
    assert produced == ref


# -- the embedded model against transformers on the same (dequantised) weights ------------------
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    ckpt = load_checkpoint(embedded_model_path())
    c = ckpt.config
    hf_cfg = transformers.LlamaConfig(
        hidden_size=c.hidden_size, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict({k: v.clone() for k, v in ckpt.weights.items()}, strict=False)
    hf.tie_weights()
    model = CausalLM(c)
    model.load_weights(ckpt.weights)
    prompts = [ckpt.tokenizer.encode(ckpt.tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                                     add_special_tokens=False) for q in CHATS]
    d = tmp_path_factory.mktemp("smol-hf")
    hf.save_pretrained(d)  # a bfloat16 run loads it the usual way (RoPE tables stay float32)
    return model, ckpt.tokenizer, {"float32": hf, "bfloat16": d}, prompts


@pytest.mark.parametrize("dtype,attention,n_prompts", [("float32", "paged", 3), ("bfloat16", "paged", 2),
                                                      ("bfloat16", "exact", 2)])
def test_embedded_model_greedy_matches_transformers(smol, dtype, attention, n_prompts):
    """The default (paged, fastest) is judged as vLLM judges engines: greedy tokens equal to
    transformers', and where they part each side's token is in the other's top-5. The `exact`
    option is bitwise transformers, so its tokens must be equal."""
    model, tok, refs, prompts = smol
    torch_dtype = getattr(torch, dtype)
    engine = LLMEngine(model.to(torch_dtype), tok, EngineConfig(dtype=dtype, attention=attention), name="smol")
    hf = refs[dtype]
    if not isinstance(hf, torch.nn.Module):
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch_dtype).eval()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=5)
    outs = engine.generate(prompts[:n_prompts], params)
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy_logprobs(hf, prompt, 64)
        if attention == "exact":
            assert out.new_token_ids == ref[0]
        else:
            # Where the CPU multiplies bfloat16 natively (oneDNN), the paged kernel's one float32
            # rounding keeps at least 16 leading tokens equal; elsewhere (no AVX512-BF16: `auto`
            # picks float32 there) bfloat16 is emulated and near-ties may part at any token, so
            # only vLLM's criterion (each side's token in the other's top-5) applies.
            leading = 16 if PackedLinear.available else 0
            assert check_greedy_close(ref, (out.new_token_ids, out.logprobs)) >= leading
    assert "Paris" in outs[0].new_text
    model.float()
