"""`ModelArgs`: the shape of a decoder-only model, read from and written to HF's config.json.

The families share one definition (`models/transformer.py`); they differ only in switches:
- qwen2: bias on q/k/v (not on o), optional tied embeddings.
- qwen3: RMSNorm on each query/key head before RoPE, explicit head_dim, no bias.
- llama: `attention_bias` on q/k/v/o, `mlp_bias` on the MLP.
- mistral: no biases; a sliding window on every layer when the config sets one.
- olmo2: norms after attention and MLP inside the residual, q/k norms over the whole projection.
- phi3: fused qkv_proj and gate_up_proj (models/fused.py), partial rotary.
- gemma3_text: GeGLU, embeddings times sqrt(hidden), (1 + w) RMSNorm, norms before and after
  attention and MLP, per-head q/k norms, sliding-window layers with their own RoPE base
  interleaved with global ones, attention scaled by query_pre_attn_scalar.
Scaled RoPE variants are models/rope.py's. Anything these switches cannot express is
rejected when the config is read, naming the key, rather than run wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from reprorl.errors import ConfigError
from reprorl.models.rope import RopeScaling

FAMILY_PREFIX = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama", "mistral": "Mistral", "olmo2": "Olmo2",
                 "phi3": "Phi3", "gemma3_text": "Gemma3"}
ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu"}  # config.json's name -> the kernel of the MLP
LAYER_TYPES = ("full_attention", "sliding_attention")
# kind -> the transformers class suffix that holds that head.
KIND_SUFFIX = {"causal_lm": "ForCausalLM", "reward": "ForSequenceClassification", "critic": "ForTokenClassification"}


@dataclass(frozen=True)
class ModelArgs:
    """Everything needed to build a model; field names follow HF's config.json."""

    model_type: str  # a key of FAMILY_PREFIX
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
    hidden_act: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, gemma3)
    sliding_window: int | None = None  # how many keys a query of a sliding layer sees, itself included
    layer_types: tuple[str, ...] = ()  # each layer's LAYER_TYPES entry; () = every layer full_attention
    local_rope_theta: float | None = None  # the sliding layers' own RoPE base, plain RoPE (gemma3)
    query_pre_attn_scalar: int | float | None = None  # scores scaled by its -1/2 power (gemma3; None: head_dim)
    sandwich_norm: bool = False  # with post_norm: the pre-norms too, a norm before and after each block (gemma3)
    norm_plus_one: bool = False  # RMSNorm weights stored as offsets from 1: normed x * (1 + w) (gemma3)
    scale_embeddings: bool = False  # the embedding's output times sqrt(hidden_size) (gemma3)
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    num_labels: int = 1  # width of the reward model's score head

    @property
    def rotary_dim(self) -> int:
        """The head dimensions RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window for the kernels: 0 (full causal) or `sliding_window`."""
        types = self.layer_types or ("full_attention",) * self.num_hidden_layers
        return tuple(self.sliding_window if t == "sliding_attention" else 0 for t in types)

    @property
    def gated(self) -> str:
        """The kernel of the MLP's gate: "swiglu" or "geglu" (`ACTIVATIONS` of `hidden_act`)."""
        return ACTIVATIONS[self.hidden_act]

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; expected one of {sorted(ACTIVATIONS)}")
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers
                                 or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise ConfigError(f"layer_types {list(self.layer_types)[:4]}... must give one of {LAYER_TYPES} for each "
                              f"of the {self.num_hidden_layers} layers")
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ConfigError(f"sliding_window={self.sliding_window}: sliding_attention layers need a window of at "
                              "least 1 token")
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
        act_key = "hidden_activation" if "hidden_activation" in config else "hidden_act"
        hidden_act = config.get(act_key) or "silu"
        if hidden_act not in ACTIVATIONS:
            raise ConfigError(f"config.json {act_key} {hidden_act!r} is not supported; expected one of "
                              f"{sorted(ACTIVATIONS)}")
        gemma3 = model_type == "gemma3_text"
        local_rope_theta = None
        if gemma3:
            config, local_rope_theta = _gemma3_global_rope(config)
        sliding_window, layer_types = _windows(config, model_type)

        heads = config["num_attention_heads"]
        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias, qk_norm = True, False, False, False
        elif model_type == "qwen3":
            attention_bias = bool(config.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias, qk_norm = attention_bias, attention_bias, False, True
        elif model_type in ("mistral", "olmo2", "phi3", "gemma3_text"):  # no biases (the rest: below)
            qkv_bias, o_bias, mlp_bias, qk_norm = False, False, False, gemma3
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
            rope_theta=_rope_theta(config),
            rope_scaling=RopeScaling.from_hf_config(config, model_type),
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            # transformers 5 defaults this to False for all three families.
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            qk_norm_whole=model_type == "olmo2",
            post_norm=model_type in ("olmo2", "gemma3_text"),
            fused_projections=model_type == "phi3",
            partial_rotary_factor=float(config.get("partial_rotary_factor")
                                        or (config.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0),
            hidden_act=hidden_act,
            sliding_window=sliding_window,
            layer_types=layer_types,
            local_rope_theta=local_rope_theta,
            query_pre_attn_scalar=config.get("query_pre_attn_scalar", 256) if gemma3 else None,
            sandwich_norm=gemma3,
            norm_plus_one=gemma3,
            scale_embeddings=gemma3,
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
        self._check_family()
        rope_scaling, rope_parameters = self.rope_scaling.to_hf(self.rope_theta)
        config: dict[str, Any] = {
            "architectures": [architecture(self.model_type, kind)],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
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
        if self.model_type in ("qwen3", "llama", "olmo2", "gemma3_text"):
            config["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            config["mlp_bias"] = self.mlp_bias
        config.update(self._hf_windows())
        if self.model_type == "gemma3_text":
            config.update(self._hf_gemma3(rope_parameters))
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

    def _check_family(self) -> None:
        """A ValueError if these switches are not ones `model_type`'s config.json can say."""
        family = self.model_type
        biases = self.qkv_bias or self.o_bias or self.mlp_bias
        if family == "qwen2" and (not self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm):
            raise ValueError("qwen2 has q/k/v bias only; these ModelArgs cannot be written as a qwen2 config")
        if family == "qwen3" and (not self.qk_norm or self.mlp_bias or self.qkv_bias != self.o_bias):
            raise ValueError("qwen3 has qk_norm and one attention_bias switch; these ModelArgs do not fit")
        if family == "llama" and (self.qk_norm or self.qkv_bias != self.o_bias):
            raise ValueError("llama has one attention_bias switch and no qk_norm; these ModelArgs do not fit")
        if family == "mistral" and (self.qk_norm or biases):
            raise ValueError("mistral has no biases and no qk_norm; these ModelArgs do not fit")
        if (family == "phi3") != self.fused_projections or family == "phi3" and (self.qk_norm or biases):
            raise ValueError("phi3 (and only phi3) has fused projections, and no biases; these ModelArgs do not fit")
        olmo2 = family == "olmo2"
        if self.qk_norm_whole != olmo2 or olmo2 and (not self.post_norm or self.qk_norm or biases):
            raise ValueError("olmo2 (and only olmo2) has whole-projection q/k norms, post-norms and no biases; "
                             "these ModelArgs do not fit")
        gemma3 = family == "gemma3_text"
        gemma_switches = (self.sandwich_norm, self.norm_plus_one, self.scale_embeddings,
                          self.local_rope_theta is not None, self.query_pre_attn_scalar is not None)
        if gemma_switches != (gemma3,) * 5 or gemma3 and (not (self.post_norm and self.qk_norm) or biases):
            raise ValueError("gemma3_text (and only gemma3_text) has sandwich and (1 + w) norms, scaled embeddings, "
                             "a local RoPE base and query_pre_attn_scalar, per-head q/k norms and no biases; "
                             "these ModelArgs do not fit")
        if self.post_norm != (olmo2 or gemma3):
            raise ValueError("only olmo2 and gemma3_text have post-norms; these ModelArgs do not fit")
        if self.layer_types and family in ("llama", "olmo2"):
            raise ValueError(f"{family} has no sliding-window layers; these ModelArgs do not fit")
        if family in ("mistral", "phi3") and len(set(self.layer_windows)) > 1:
            raise ValueError(f"{family}'s sliding window is on every layer or none; these ModelArgs do not fit")

    def _hf_windows(self) -> dict[str, Any]:
        """config.json's sliding-window keys, in each family's own words."""
        window = self.sliding_window if any(self.layer_windows) else None
        if self.model_type in ("qwen2", "qwen3"):
            if window is None:
                return {"use_sliding_window": False}
            # transformers 4.x makes layers i >= max_window_layers sliding; 5.x reads layer_types
            first = next((i for i, w in enumerate(self.layer_windows) if w), self.num_hidden_layers)
            if any(not w for w in self.layer_windows[first:]):
                raise ValueError("qwen's sliding layers are the last ones; these layer_types do not fit")
            return {"use_sliding_window": True, "sliding_window": window,
                    "max_window_layers": first, "layer_types": self._layer_types_list()}
        if self.model_type in ("mistral", "phi3"):
            return {"sliding_window": window}
        return {}

    def _layer_types_list(self) -> list[str]:
        return ["sliding_attention" if w else "full_attention" for w in self.layer_windows]

    def _hf_gemma3(self, rope_parameters: dict[str, Any]) -> dict[str, Any]:
        """gemma3_text's own keys: its activation's name, both RoPEs, the window, the scalar."""
        local = {"rope_type": "default", "rope_theta": self.local_rope_theta}
        return {
            "hidden_activation": self.hidden_act,
            "rope_parameters": {"full_attention": rope_parameters, "sliding_attention": local},
            "rope_local_base_freq": self.local_rope_theta,  # 4.x
            "sliding_window": self.sliding_window,
            "layer_types": self._layer_types_list(),
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "use_bidirectional_attention": False,
        }


def model_dtype(args: ModelArgs, dtype: torch.dtype | None = None) -> torch.dtype:
    """`dtype` if given, else the checkpoint's (`torch_dtype`)."""
    return dtype if dtype is not None else getattr(torch, args.torch_dtype)


def architecture(model_type: str, kind: str) -> str:
    """transformers' class name of a `kind` of `model_type` (config.json's architectures)."""
    if model_type == "gemma3_text" and kind != "causal_lm":  # Gemma3ForSequenceClassification is the multimodal one
        return "Gemma3Text" + KIND_SUFFIX[kind]
    return FAMILY_PREFIX[model_type] + KIND_SUFFIX[kind]


def _windows(config: dict[str, Any], model_type: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) of a config.json, as transformers reads each family's;
    (None, ()) where no layer's window binds (a window as long as the positions)."""
    window = config.get("sliding_window")
    layers = config["num_hidden_layers"]
    if model_type in ("llama", "olmo2"):
        return None, ()
    if model_type in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window"):
            return None, ()
        first = config.get("max_window_layers", layers)
        types = config.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                              for i in range(layers)]
    elif model_type == "gemma3_text":
        if config.get("use_bidirectional_attention"):
            raise ConfigError("config.json use_bidirectional_attention=true (model_type gemma3_text) is not "
                              "supported; expected false (a causal language model)")
        pattern = config.get("sliding_window_pattern", 6)
        types = config.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                              for i in range(layers)]
    else:  # mistral, phi3: every layer, when set
        types = ["sliding_attention"] * layers
    if window is None or window >= config.get("max_position_embeddings", 32768) \
            or "sliding_attention" not in types:
        return None, ()
    if not isinstance(window, int) or window < 1:
        raise ConfigError(f"config.json sliding_window={window!r} (model_type {model_type}); expected a whole "
                          "number of tokens, at least 1")
    return window, tuple(types)


def _gemma3_global_rope(config: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(config with the global layers' RoPE where every family keeps it, the sliding layers'
    base). transformers 5 nests both under rope_parameters; 4.x has rope_theta, rope_scaling
    and rope_local_base_freq. Softcapping is refused, naming the key."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            raise ConfigError(f"config.json {key}={config[key]} (model_type gemma3_text) is not supported; "
                              "expected null (Gemma 3 sets none)")
    params = config.get("rope_parameters") or {}
    if "full_attention" not in params and "sliding_attention" not in params:
        return dict(config, rope_theta=config.get("rope_theta", 1e6)), float(config.get("rope_local_base_freq", 1e4))
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"config.json rope_parameters.sliding_attention rope_type {local['rope_type']!r} "
                          "(model_type gemma3_text) is not supported; expected 'default'")
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    full.setdefault("rope_theta", config.get("rope_theta", 1e6))
    return dict(config, rope_parameters=full), float(local.get("rope_theta", config.get("rope_local_base_freq", 10000.0)))


def _rope_theta(config: dict[str, Any]) -> float:
    """RoPE base from either layout (transformers 5 keeps it in rope_parameters)."""
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
