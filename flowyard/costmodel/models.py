"""Model shapes: the numbers of a Llama/Qwen2-family decoder that fix its FLOPs and bytes.

The catalog holds the real shapes from each model's Hugging Face `config.json`; any other
Llama/Qwen2/Mistral-style checkpoint is read with `ModelSpec.from_hf_config`. Qwen2.5's
q/k/v biases are ignored (their FLOPs and bytes are < 0.1 % of the projections).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flowyard.costmodel.catalog import CatalogError, lookup

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a dense decoder-only transformer with GQA attention and a SwiGLU MLP."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    bytes_per_param: int = 2  # bf16

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads {self.heads} not a multiple of kv_heads")

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer: fused QKV, O, fused gate+up, down (norms ~0)."""
        h = self.hidden
        return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 3 * h * self.intermediate

    @property
    def num_params(self) -> int:
        emb = self.vocab * self.hidden
        return self.layers * self.layer_params + emb * (1 if self.tied_embeddings else 2)

    def flops(self, tokens: float, attn_pairs: float = 0.0, sampled: float = 0.0) -> float:
        """Model FLOPs (the MFU numerator) of a forward pass over `tokens` tokens whose
        attention scores `attn_pairs` query-key pairs, `sampled` rows going through lm_head:
        2 FLOPs per weight per token, and 4 per head dimension per pair (QK^T and PV)."""
        return (2.0 * self.layers * self.layer_params * tokens
                + 4.0 * self.layers * self.q_dim * attn_pairs
                + 2.0 * self.hidden * self.vocab * sampled)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, unsharded: 2 * layers * kv_heads * d * bytes."""
        return 2 * self.layers * self.kv_dim * self.bytes_per_param

    @classmethod
    def from_hf_config(cls, path: str | Path, name: str | None = None) -> "ModelSpec":
        """Read a Hugging Face `config.json` (or a directory holding one): Llama, Qwen2 and
        Mistral use the same keys. Missing `num_key_value_heads` means MHA; missing
        `head_dim` means hidden / heads."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            cfg = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CatalogError(f"cannot read model config {str(p)!r}: {e}") from e
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            return cls(
                name=name or cfg.get("_name_or_path") or p.parent.name or "custom",
                hidden=hidden,
                layers=int(cfg["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate=int(cfg["intermediate_size"]),
                vocab=int(cfg["vocab_size"]),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bytes_per_param=_DTYPE_BYTES.get(str(cfg.get("torch_dtype", "bfloat16")), 2),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CatalogError(f"{str(p)!r} is not a Llama/Qwen2-style config: {e}") from e


def _llama3_8b(name: str) -> ModelSpec:
    return ModelSpec(name, hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                     intermediate=14336, vocab=128256)


# Shapes from each model's config.json on the Hugging Face Hub.
MODELS: dict[str, ModelSpec] = {
    "llama-3-8b": _llama3_8b("llama-3-8b"),
    "llama-3.1-8b": _llama3_8b("llama-3.1-8b"),
    "llama-3-70b": ModelSpec("llama-3-70b", hidden=8192, layers=80, heads=64, kv_heads=8,
                             head_dim=128, intermediate=28672, vocab=128256),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", hidden=3584, layers=28, heads=28, kv_heads=4,
                            head_dim=128, intermediate=18944, vocab=152064),
    "qwen2.5-14b": ModelSpec("qwen2.5-14b", hidden=5120, layers=48, heads=40, kv_heads=8,
                             head_dim=128, intermediate=13824, vocab=152064),
    "qwen2.5-32b": ModelSpec("qwen2.5-32b", hidden=5120, layers=64, heads=40, kv_heads=8,
                             head_dim=128, intermediate=27648, vocab=152064),
    "qwen2.5-72b": ModelSpec("qwen2.5-72b", hidden=8192, layers=80, heads=64, kv_heads=8,
                             head_dim=128, intermediate=29568, vocab=152064),
    "smollm2-135m": ModelSpec("smollm2-135m", hidden=576, layers=30, heads=9, kv_heads=3,
                              head_dim=64, intermediate=1536, vocab=49152, tied_embeddings=True),
}
MODEL_NAMES: tuple[str, ...] = tuple(MODELS)


def get_model(name_or_path: str | Path | ModelSpec) -> ModelSpec:
    """A catalog model by (case-insensitive) name, or the shape in a config.json path."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    s = str(name_or_path)
    if s.strip().lower() not in MODELS and (Path(s).is_file() or Path(s, "config.json").is_file()):
        return ModelSpec.from_hf_config(s)
    return lookup("model", s, MODELS, extra=" (or a path to a config.json)")
