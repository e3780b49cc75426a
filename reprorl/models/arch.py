"""`ModelArgs`: the shape of a decoder-only model, read from and written to HF's config.json.

Three families share one definition; they differ only in a few switches:
- qwen2: bias on q/k/v (not on o), optional tied embeddings.
- qwen3: RMSNorm on each query/key head before RoPE, explicit head_dim, no bias.
- llama: `attention_bias` on q/k/v/o, `mlp_bias` on the MLP, plain RoPE only.
Anything these switches cannot express (sliding windows, scaled RoPE, other activations)
is rejected when the config is read, naming the key, rather than run wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reprorl.errors import ConfigError
from reprorl.models.rope import RopeScaling

FAMILY_PREFIX = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama", "mistral": "Mistral", "olmo2": "Olmo2",
                 "phi3": "Phi3"}
# kind -> the transformers class suffix that holds that head.
KIND_SUFFIX = {"causal_lm": "ForCausalLM", "reward": "ForSequenceClassification", "critic": "ForTokenClassification"}


@dataclass(frozen=True)
class ModelArgs:
    """Everything needed to build a model; field names follow HF's config.json."""

    model_type: str  # "qwen2" | "qwen3" | "llama" | "mistral" | "olmo2" | "phi3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()  # plain RoPE, or a scaled variant (models/rope.py)
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q_proj, k_proj, v_proj
    o_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False  # bias on gate_proj, up_proj, down_proj
    qk_norm: bool = False  # per-head RMSNorm on queries and keys (qwen3)
    qk_norm_whole: bool = False  # RMSNorm over the whole q and k projections, before the heads (olmo2)
    post_norm: bool = False  # norms after attention and MLP, inside the residual (olmo2)
    fused_projections: bool = False  # the checkpoint's qkv_proj and gate_up_proj (phi3: models/fused.py)
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions RoPE rotates (phi3)
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    num_labels: int = 1  # width of the reward model's score head

    @property
    def rotary_dim(self) -> int:
        """The head dimensions RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def __post_init__(self) -> None:
        if self.model_type not in FAMILY_PREFIX:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; expected one of {sorted(FAMILY_PREFIX)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArgs:
        """Read a config.json dict (transformers 4.x or 5.x layout)."""
        model_type = config.get("model_type")
        if model_type not in FAMILY_PREFIX:
            raise ConfigError(
                f"config.json model_type {model_type!r} is not supported; expected one of {sorted(FAMILY_PREFIX)}"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json hidden_act {config['hidden_act']!r} is not supported; expected 'silu'")
        if config.get("use_sliding_window"):
            raise ConfigError("config.json use_sliding_window=true is not supported; expected false (full attention)")
        window = config.get("sliding_window")
        if model_type in ("mistral", "phi3") and window is not None \
                and window < config.get("max_position_embeddings", 32768):
            raise ConfigError(f"config.json sliding_window={window} (model_type {model_type}) is not supported yet; "
                              "expected null or at least max_position_embeddings (full attention)")
        rope_theta = _rope_theta(config)

        heads = config["num_attention_heads"]
        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias, qk_norm = True, False, False, False
        elif model_type == "qwen3":
            attention_bias = bool(config.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias, qk_norm = attention_bias, attention_bias, False, True
        elif model_type in ("mistral", "olmo2", "phi3"):  # no biases (olmo2's norms, phi3's fusion: below)
            qkv_bias, o_bias, mlp_bias, qk_norm = False, False, False, False
        else:
            attention_bias = bool(config.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias, qk_norm = (
                attention_bias,
                attention_bias,
                bool(config.get("mlp_bias", False)),
                False,
            )
        if "num_labels" in config:
            num_labels = int(config["num_labels"])
        elif config.get("id2label"):
            num_labels = len(config["id2label"])
        else:
            num_labels = 1
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=RopeScaling.from_hf_config(config, model_type),
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            # transformers 5 defaults this to False for all three families.
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            qk_norm_whole=model_type == "olmo2",
            post_norm=model_type == "olmo2",
            fused_projections=model_type == "phi3",
            partial_rotary_factor=float(config.get("partial_rotary_factor")
                                        or (config.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            pad_token_id=config.get("pad_token_id"),
            num_labels=num_labels,
        )

    def to_hf_config(self, kind: str = "causal_lm") -> dict[str, Any]:
        """The config.json dict transformers (4.x and 5.x) and vLLM load for this `kind`.

        kind: "causal_lm" | "reward" (XForSequenceClassification) | "critic" (XForTokenClassification).
        No transformers_version key, so the bytes do not depend on the installed version.
        """
        if kind not in KIND_SUFFIX:
            raise ValueError(f"kind {kind!r}; expected one of {sorted(KIND_SUFFIX)}")
        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm):
            raise ValueError("qwen2 has q/k/v bias only; these ModelArgs cannot be written as a qwen2 config")
        if self.model_type == "qwen3" and (not self.qk_norm or self.mlp_bias or self.qkv_bias != self.o_bias):
            raise ValueError("qwen3 has qk_norm and one attention_bias switch; these ModelArgs do not fit")
        if self.model_type == "llama" and (self.qk_norm or self.qkv_bias != self.o_bias):
            raise ValueError("llama has one attention_bias switch and no qk_norm; these ModelArgs do not fit")
        if self.model_type == "mistral" and (self.qk_norm or self.qkv_bias or self.o_bias or self.mlp_bias):
            raise ValueError("mistral has no biases and no qk_norm; these ModelArgs do not fit")
        if (self.model_type == "phi3") != self.fused_projections or self.model_type == "phi3" and (
                self.qk_norm or self.qkv_bias or self.o_bias or self.mlp_bias):
            raise ValueError("phi3 (and only phi3) has fused projections, and no biases; these ModelArgs do not fit")
        olmo2 = self.model_type == "olmo2"
        if (self.qk_norm_whole, self.post_norm) != (olmo2, olmo2) or olmo2 and (
                self.qk_norm or self.qkv_bias or self.o_bias or self.mlp_bias):
            raise ValueError("olmo2 (and only olmo2) has post-norms and whole-projection q/k norms, no biases; "
                             "these ModelArgs do not fit")
        rope_scaling, rope_parameters = self.rope_scaling.to_hf(self.rope_theta)
        config: dict[str, Any] = {
            "architectures": [FAMILY_PREFIX[self.model_type] + KIND_SUFFIX[kind]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            # 4.x reads rope_theta + rope_scaling; 5.x reads rope_parameters.
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "torch_dtype": self.torch_dtype,
            "dtype": self.torch_dtype,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type in ("qwen3", "llama", "olmo2"):
            config["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            config["mlp_bias"] = self.mlp_bias
        if self.model_type in ("qwen2", "qwen3"):
            config["use_sliding_window"] = False
        if self.model_type in ("mistral", "phi3"):
            config["sliding_window"] = None
        if self.partial_rotary_factor != 1.0:
            config["partial_rotary_factor"] = self.partial_rotary_factor
            config["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
        original = self.rope_scaling.get("original_max_position_embeddings")
        if self.model_type == "phi3" and original is not None:  # where transformers 4.x's Phi-3 reads it
            config["original_max_position_embeddings"] = original
        if kind != "causal_lm":
            labels = self.num_labels if kind == "reward" else 1
            config["num_labels"] = labels
            config["id2label"] = {str(i): f"LABEL_{i}" for i in range(labels)}
            config["label2id"] = {f"LABEL_{i}": i for i in range(labels)}
        return config


def _rope_theta(config: dict[str, Any]) -> float:
    """RoPE base from either layout (transformers 5 keeps it in rope_parameters)."""
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
