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


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("kind", ["causal_lm", "reward", "critic"])
def test_round_trip_through_transformers(family, kind):
    config_cls = {
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "llama": transformers.LlamaConfig,
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
    assert loaded.rope_parameters["rope_theta"] == 12345.0
    reread = ModelArgs.from_hf_config(loaded.to_dict())
    if kind == "causal_lm":  # transformers' default id2label has 2 labels; no head reads it
        reread = dataclasses.replace(reread, num_labels=args.num_labels)
    assert reread == args


def test_unsupported_model_type_is_named():
    with pytest.raises(ConfigError, match="'gemma3_text'"):
        ModelArgs.from_hf_config({"model_type": "gemma3_text"})


def test_a_mistral_sliding_window_is_refused_and_a_null_one_is_llamas_layers():
    config = {"model_type": "mistral", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
              "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32768}
    with pytest.raises(ConfigError, match="config.json sliding_window=4096 \\(model_type mistral\\) is not supported"):
        ModelArgs.from_hf_config({**config, "sliding_window": 4096})
    args = ModelArgs.from_hf_config({**config, "sliding_window": None, "attention_bias": True})
    assert not (args.qkv_bias or args.o_bias or args.mlp_bias or args.qk_norm)
    assert ModelArgs.from_hf_config(args.to_hf_config()) == args


@pytest.mark.parametrize(
    "extra, pattern",
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'llama3' needs low_freq_factor"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "'yarn' needs factor"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "'gelu'"),
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
