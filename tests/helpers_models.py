"""Tiny random Llama/Qwen2 checkpoints on disk, for engine tests that must not download anything.

`make_tiny_model(tmp_path, "llama")` writes what a Hugging Face model directory holds:
config.json + safetensors (optionally sharded) from transformers' own `save_pretrained`,
a byte-level BPE `tokenizer.json` (256 byte tokens + ChatML specials, no merges) and a
`tokenizer_config.json` with a chat template. Needs transformers (tests importorskip it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 272  # 256 bytes + 3 specials, padded like real vocabularies

CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set loop_messages = messages[1:] %}{%- else %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{%- set loop_messages = messages %}"
    "{%- endif %}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + message['role']) }}"
    "{%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if tools %}{{ '<tools>' + (tools | tojson) + '</tools>' }}{%- endif %}\n"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}\n"
)


def byte_level_tokenizer_json() -> str:
    """A valid byte-level BPE tokenizer.json: every byte is a token, specials after them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from flowyard.engine.tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab, [], continuing_subword_prefix="", end_of_word_suffix=""))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in SPECIALS])
    return tok.to_str()


def make_tiny_model(root: Path, arch: str, *, tied: bool = False, shard: bool = False,
                    template_file: bool = False, seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write a random tiny `arch` model into root/arch; return (dir, its state_dict)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64}, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(rope_theta=1e6, **common))
    else:
        raise ValueError(arch)
    with torch.no_grad():  # biases start at zero: make them visible to the comparison
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    d = root / f"{arch}{'-tied' if tied else ''}{'-sharded' if shard else ''}"
    model.save_pretrained(d, max_shard_size="40KB" if shard else "5GB")
    (d / "tokenizer.json").write_text(byte_level_tokenizer_json(), encoding="utf-8")
    tc = {"bos_token": "<|im_start|>", "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True},
          "unk_token": None, "model_max_length": 256, "tokenizer_class": "PreTrainedTokenizerFast"}
    if template_file:
        (d / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    else:
        tc["chat_template"] = CHATML_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(tc), encoding="utf-8")
    return d, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _permute_for_gguf(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.LlamaModel.permute: HF half-split rotary rows -> llama.cpp interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, arch: str, state: dict[str, torch.Tensor], *, q8_names: tuple[str, ...] = (),
                    rope_freqs: torch.Tensor | None = None) -> Path:
    """Write `state` (a tiny model from make_tiny_model) as a GGUF the way llama.cpp's converter does.

    Tensors are F32 (exact round trip) except those in `q8_names` (Q8_0). Llama q/k rows are
    permuted like convert_hf_to_gguf; the tokenizer is the byte-level one plus ChatML controls.
    """
    import gguf

    from flowyard.engine.tokenizer import bytes_to_unicode

    heads, kv_heads, layers = 4, 2, 2
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1e6)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    tokens = list(bytes_to_unicode().values()) + SPECIALS
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * len(SPECIALS))
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    w.add_chat_template(CHATML_TEMPLATE)
    rename = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, t in state.items():
        if name.startswith("model.layers."):
            _, _, i, mod, sub, kind = (name.split(".") + [""])[:6]
            mod, kind = (f"{mod}.{sub}", kind) if kind else (mod, sub)
            gname = f"blk.{i}.{rename[mod]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if arch == "llama" and ".attn_q." in gname:
            t = _permute_for_gguf(t, heads)
        elif arch == "llama" and ".attn_k." in gname:
            t = _permute_for_gguf(t, kv_heads)
        arr = t.float().contiguous().numpy()
        if name in q8_names:
            w.add_tensor(gname, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, arr)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_model(path: Path):
    """(CausalLM, tokenizer) of a checkpoint directory, as the engine loads it."""
    from flowyard.engine.loader import load_checkpoint
    from flowyard.engine.model import CausalLM

    ckpt = load_checkpoint(path)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    return model, ckpt.tokenizer


def tiny_model(root: Path, arch: str = "llama"):
    """A tiny random checkpoint written under `root` and loaded: (CausalLM, tokenizer)."""
    d, _ = make_tiny_model(root, arch)
    return load_model(d)
