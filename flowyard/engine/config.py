"""The shape of a Llama/Qwen2-family decoder, independent of where the weights came from.

`ModelConfig` is what the model code reads; it is filled either from a Hugging Face
`config.json` (`ModelConfig.from_hf`) or from GGUF metadata (see `loader.py`), so the model
never has to know about either format. It also owns the RoPE frequency computation, because
the scaling variants (none, linear, Llama-3, GGUF per-dimension factors) are properties of the
checkpoint rather than of the attention code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

SUPPORTED_ARCHS = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only Llama/Qwen2 model (RMSNorm, RoPE, GQA, SwiGLU).

    `attention_bias` means q/k/v projections carry a bias (always true for Qwen2);
    `o_proj_bias` is only set by Llama configs with `attention_bias: true`, where HF also
    gives o_proj a bias. `rope_scaling` is None or a dict with a `rope_type` key:
    "linear" (factor), "llama3" (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings) or "freq_factors" (llama.cpp's `rope_freqs` tensor,
    a per-dimension divisor stored as the tuple `factors`).
    """

    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    o_proj_bias: bool = False

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    def __hash__(self) -> int:  # rope_scaling is a dict: hash the scalar identity only
        return hash((self.arch, self.hidden_size, self.num_layers, self.num_heads, self.vocab_size))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict (transformers v4 or v5 layout).

        v5 moved `rope_theta`/`rope_scaling` into `rope_parameters`; both are accepted. EOS ids
        are the union of config.json's and generation_config.json's, because instruct models
        often list the chat end token only in the latter.
        """
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        if model_type == "qwen2" and cfg.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if cfg.get(k) is None]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or rope_params
        rope_scaling = normalize_rope_scaling(scaling)
        eos: list[int] = []
        for src in (cfg, generation_config or {}):
            for tok in _as_list(src.get("eos_token_id")):
                if tok not in eos:
                    eos.append(int(tok))
        attn_bias = bool(cfg.get("attention_bias", False))
        return cls(
            arch=model_type,
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else attn_bias,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
            eos_token_ids=tuple(eos),
            o_proj_bias=model_type == "llama" and attn_bias,
        )

    def rope_inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Inverse frequencies (head_dim // 2,) in float32, with this checkpoint's scaling applied.

        Matches transformers' `ROPE_INIT_FUNCTIONS` for default/linear/llama3 (whose attention
        scaling factor is 1, so cos/sin need no extra multiplier) and llama.cpp for GGUF
        `rope_freqs` factors.
        """
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        s = self.rope_scaling or {}
        kind = s.get("rope_type", "default")
        if kind == "linear":
            inv = inv / float(s["factor"])
        elif kind == "llama3":
            inv = _llama3_inv_freq(inv, s)
        elif kind == "freq_factors":
            inv = inv / torch.tensor(s["factors"], dtype=torch.float32)
        elif kind != "default":
            raise ValueError(f"unsupported rope scaling {kind!r}")
        return inv.to(device) if device is not None else inv


def normalize_rope_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Canonical rope_scaling dict or None; rejects variants the engine does not implement."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(scaling["factor"])}
    if kind == "llama3":
        return {
            "rope_type": "llama3",
            "factor": float(scaling["factor"]),
            "low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
        }
    if kind == "freq_factors":
        return {"rope_type": "freq_factors", "factors": tuple(float(x) for x in scaling["factors"])}
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3)")


def _llama3_inv_freq(inv: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    """Llama-3.1 frequency remap: long wavelengths scaled by `factor`, short kept, smooth between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, out)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
