"""Model shapes: the numbers of a Llama/Qwen2-family decoder that fix its FLOPs and bytes.

The catalog holds the real shapes from each model's Hugging Face `config.json`; any other
Llama/Qwen2/Mistral-style checkpoint is read with `ModelSpec.from_hf_config`. Qwen2.5's
q/k/v biases are ignored (their FLOPs and bytes are < 0.1 % of the projections), as are
Qwen3's per-head q/k RMSNorms (a head_dim vector each).

A mixture-of-experts model (`experts` > 0) replaces every layer's MLP by a router GEMM
(hidden -> experts) that sends each token to `experts_active` of `experts` SwiGLU experts of
width `expert_intermediate`, plus an always-on shared expert of width `shared_intermediate`
where the model has one: its FLOPs follow the active parameters, its memory all of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flowyard.costmodel.catalog import CatalogError, lookup

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer with GQA attention and a SwiGLU MLP, dense or a
    mixture of experts (see the module docstring)."""

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
    # Mixture of experts (0 experts: a dense MLP of width `intermediate`). In an MoE model
    # `intermediate` is the width of a dense MLP beside the experts, 0 when every layer is sparse.
    experts: int = 0
    experts_active: int = 0  # experts each token is routed to (top-k)
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # an always-on shared expert's width (0: none)

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads {self.heads} not a multiple of kv_heads")
        if self.experts and not (0 < self.experts_active <= self.experts and self.expert_intermediate > 0):
            raise ValueError(f"{self.name}: an MoE model needs 0 < experts_active <= experts and "
                             f"expert_intermediate > 0 (got {self.experts_active} of {self.experts}, "
                             f"width {self.expert_intermediate})")
        if not self.experts and (self.experts_active or self.expert_intermediate or self.shared_intermediate):
            raise ValueError(f"{self.name}: expert fields set on a dense model (experts=0)")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer: fused QKV, O, fused gate+up, down (norms ~0); an MoE
        layer adds its router and every expert (what memory must hold)."""
        h = self.hidden
        dense = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 3 * h * self.intermediate
        if not self.experts:
            return dense
        return dense + h * self.experts + 3 * h * (self.experts * self.expert_intermediate
                                                   + self.shared_intermediate)

    @property
    def active_layer_params(self) -> int:
        """Weights one token multiplies in a layer: the dense layer's, or for an MoE layer the
        router's and `experts_active` experts' (what its FLOPs follow)."""
        if not self.experts:
            return self.layer_params
        h = self.hidden
        return (h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 3 * h * self.intermediate
                + h * self.experts + 3 * h * (self.experts_active * self.expert_intermediate
                                              + self.shared_intermediate))

    @property
    def active_params(self) -> int:
        """Parameters one token uses (all of them for a dense model)."""
        emb = self.vocab * self.hidden
        return self.layers * self.active_layer_params + emb * (1 if self.tied_embeddings else 2)

    @property
    def num_params(self) -> int:
        emb = self.vocab * self.hidden
        return self.layers * self.layer_params + emb * (1 if self.tied_embeddings else 2)

    def flops(self, tokens: float, attn_pairs: float = 0.0, sampled: float = 0.0) -> float:
        """Model FLOPs (the MFU numerator) of a forward pass over `tokens` tokens whose
        attention scores `attn_pairs` query-key pairs, `sampled` rows going through lm_head:
        2 FLOPs per active weight per token, and 4 per head dimension per pair (QK^T and PV)."""
        return (2.0 * self.layers * self.active_layer_params * tokens
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
        `head_dim` means hidden / heads. MoE: Qwen2-MoE/Qwen3-MoE (`num_experts`,
        `moe_intermediate_size`, `shared_expert_intermediate_size`) and Mixtral
        (`num_local_experts`, experts `intermediate_size` wide), all layers sparse."""
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
            moe = _moe_fields(cfg)
            return cls(
                name=name or cfg.get("_name_or_path") or p.parent.name or "custom",
                hidden=hidden,
                layers=int(cfg["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate=0 if moe else int(cfg["intermediate_size"]),
                vocab=int(cfg["vocab_size"]),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bytes_per_param=_DTYPE_BYTES.get(str(cfg.get("torch_dtype", "bfloat16")), 2),
                **moe,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CatalogError(f"{str(p)!r} is not a Llama/Qwen2-style config: {e}") from e


def _moe_fields(cfg: dict) -> dict[str, int]:
    """The expert fields of an HF config, {} for a dense model. A config that mixes dense and
    sparse layers (`decoder_sparse_step` > 1 or `mlp_only_layers`) is refused: the spec prices
    every layer alike."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return {}
    if int(cfg.get("decoder_sparse_step") or 1) != 1 or cfg.get("mlp_only_layers"):
        raise ValueError("mixed dense and MoE layers (decoder_sparse_step / mlp_only_layers) are not modelled")
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]  # Mixtral: experts are the MLP
    return {"experts": experts, "experts_active": int(cfg["num_experts_per_tok"]),
            "expert_intermediate": int(width),
            "shared_intermediate": int(cfg.get("shared_expert_intermediate_size") or 0)}


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
    # Qwen/Qwen3-30B-A3B config.json: every layer sparse (decoder_sparse_step 1, no
    # mlp_only_layers, so its dense intermediate_size 6144 is unused), 128 experts, top-8, no
    # shared expert; 30.5B parameters, 3.3B active per token.
    "qwen3-30b-a3b": ModelSpec("qwen3-30b-a3b", hidden=2048, layers=48, heads=32, kv_heads=4,
                               head_dim=128, intermediate=0, vocab=151936, experts=128,
                               experts_active=8, expert_intermediate=768),
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
