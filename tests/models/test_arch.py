"""ModelArgs <-> config.json for the three families, and the errors for what is not supported."""

import dataclasses

import pytest
import transformers

from reprorl.errors import ConfigError
from reprorl.models.arch import ModelArgs


def hf_dict(config_cls, **kwargs):
    return config_cls(**kwargs).to_dict()


def test_qwen2_from_transformers_config():
    args = ModelArgs.from_hf_config(
        hf_dict(
            transformers.Qwen2Config,
            hidden_size=896,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            num_hidden_layers=24,
            vocab_size=151936,
            tie_word_embeddings=True,
            rope_theta=1e6,
        )
    )
    assert (args.model_type, args.head_dim, args.num_key_value_heads) == ("qwen2", 64, 2)
    assert (args.qkv_bias, args.o_bias, args.mlp_bias, args.qk_norm) == (True, False, False, False)
    assert args.tie_word_embeddings and args.rope_theta == 1e6


def test_qwen3_and_llama_switches():
    qwen3 = ModelArgs.from_hf_config(hf_dict(transformers.Qwen3Config, head_dim=96, hidden_size=512))
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias, qwen3.o_bias) == (96, True, False, False)
    llama = ModelArgs.from_hf_config(hf_dict(transformers.LlamaConfig, attention_bias=True, mlp_bias=True))
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.qk_norm) == (True, True, True, False)


def test_transformers_4_layout():
    """Older config.json files keep rope_theta at the top and rope_scaling null, and torch_dtype."""
    config = {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "torch_dtype": "bfloat16",
    }
    args = ModelArgs.from_hf_config(config)
    assert (args.rope_theta, args.torch_dtype, args.num_key_value_heads, args.head_dim) == (500000.0, "bfloat16", 8, 32)
    assert not args.tie_word_embeddings


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "gemma3_text"])
@pytest.mark.parametrize("kind", ["causal_lm", "reward", "critic"])
def test_round_trip_through_transformers(family, kind):
    config_cls = {
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "llama": transformers.LlamaConfig,
        "gemma3_text": transformers.Gemma3TextConfig,
    }[family]
    args = ModelArgs.from_hf_config(
        hf_dict(
            config_cls,
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=256,
            num_hidden_layers=2,
            vocab_size=100,
            rope_theta=12345.0,
            num_labels=1,
            pad_token_id=0,
        )
    )
    written = args.to_hf_config(kind)
    assert ModelArgs.from_hf_config(written) == args
    # transformers reads the same shape back.
    loaded = transformers.AutoConfig.for_model(**written)
    assert loaded.architectures == written["architectures"]
    rope = loaded.rope_parameters.get("full_attention", loaded.rope_parameters)  # gemma3: global layers'
    assert rope["rope_theta"] == 12345.0
    reread = ModelArgs.from_hf_config(loaded.to_dict())
    if kind == "causal_lm":  # transformers' default id2label has 2 labels; no head reads it
        reread = dataclasses.replace(reread, num_labels=args.num_labels)
    assert reread == args


def test_unsupported_model_type_is_named():
    with pytest.raises(ConfigError, match="'gemma2'"):
        ModelArgs.from_hf_config({"model_type": "gemma2"})


def test_sliding_windows_as_transformers_reads_each_family():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 4,
            "num_attention_heads": 2, "max_position_embeddings": 32768}
    mistral = {**base, "model_type": "mistral"}
    assert ModelArgs.from_hf_config({**mistral, "sliding_window": 4096}).layer_windows == (4096,) * 4
    args = ModelArgs.from_hf_config({**mistral, "sliding_window": None, "attention_bias": True})
    assert not (args.qkv_bias or args.o_bias or args.mlp_bias or args.qk_norm) and args.layer_windows == (0,) * 4
    assert ModelArgs.from_hf_config(args.to_hf_config()) == args
    # a window as long as the positions never binds: full attention, the same bits
    assert ModelArgs.from_hf_config({**mistral, "sliding_window": 32768}).layer_windows == (0,) * 4
    qwen = {**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 3}
    assert ModelArgs.from_hf_config(qwen).layer_windows == (0, 0, 0, 64)
    assert ModelArgs.from_hf_config({**qwen, "use_sliding_window": False}).layer_windows == (0,) * 4
    gemma = {**base, "model_type": "gemma3_text", "sliding_window": 512, "sliding_window_pattern": 2}
    args = ModelArgs.from_hf_config(gemma)  # 4.x's pattern: every 2nd layer global
    assert args.layer_windows == (512, 0, 512, 0) and (args.rope_theta, args.local_rope_theta) == (1e6, 1e4)
    assert ModelArgs.from_hf_config(args.to_hf_config()) == args
    with pytest.raises(ConfigError, match="sliding_window=0 \\(model_type mistral\\); expected a whole number"):
        ModelArgs.from_hf_config({**mistral, "sliding_window": 0})


@pytest.mark.parametrize(
    "extra, pattern",
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'llama3' needs low_freq_factor"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "'yarn' needs factor"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"model_type": "gemma3_text", "hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"model_type": "gemma3_text", "rope_parameters": {"sliding_attention": {"rope_type": "linear"}}},
         "rope_parameters.sliding_attention rope_type 'linear'"),
    ],
)
def test_unsupported_features_are_rejected(extra, pattern):
    config = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        **extra,
    }
    with pytest.raises(ConfigError, match=pattern):
        ModelArgs.from_hf_config(config)


def test_heads_must_group():
    with pytest.raises(ConfigError, match="num_key_value_heads=3"):
        ModelArgs.from_hf_config(
            {
                "model_type": "qwen2",
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 3,
            }
        )
