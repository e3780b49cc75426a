"""Scaled RoPE (reprorl/models/rope.py) against transformers: each variant's inverse
frequencies and attention factor bit for bit, and a Llama with it end to end (float32
logits within 1e-5 on left-padded batches whose positions pass the scaling threshold)."""

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernel_modes import on_kernels
from padded_batch import padded_batch
from reprorl.errors import ConfigError
from reprorl.models.arch import ModelArgs
from reprorl.models.hf_io import load_model, save_model
from reprorl.models.rope import RopeScaling, inverse_frequencies

# Thresholds inside a 96-token sequence: llama3's and yarn's original length 32, so the
# scaled frequencies matter at the positions the batch reaches.
VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    # longrope: transformers' short factors up to the original length (the module doc)
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 128,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + i for i in range(8)]},
}
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=5e5, pad_token_id=0, eos_token_id=2)


def llama_config(variant: str) -> transformers.LlamaConfig:
    max_positions = 256 if variant == "longrope" else 128  # longrope: factor = 256 / 128
    return transformers.LlamaConfig(**SMALL, max_position_embeddings=max_positions,
                                    rope_parameters={**VARIANTS[variant], "rope_theta": 5e5})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_inverse_frequencies_and_attention_factor_are_transformers_bits(variant):
    config = llama_config(variant)
    expected, factor = ROPE_INIT_FUNCTIONS[VARIANTS[variant]["rope_type"]](config, "cpu")
    args = ModelArgs.from_hf_config(config.to_dict())
    got, got_factor = inverse_frequencies(args.rope_scaling, args.head_dim, args.rope_theta,
                                          args.max_position_embeddings)
    assert got.dtype == torch.float32 and torch.equal(got, expected.float())
    assert got_factor == factor
    assert not torch.equal(got, inverse_frequencies(RopeScaling(), 16, 5e5, 128)[0])  # it does scale


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_scaled_llama_matches_transformers_past_the_threshold(variant, tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(llama_config(variant)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.15 * torch.randn(param.shape, generator=g))
    hf.save_pretrained(tmp_path)
    model, args = load_model(tmp_path)
    assert args.rope_scaling.rope_type == VARIANTS[variant]["rope_type"]
    ids, mask, pos = padded_batch(96, lengths=(96, 70, 5))  # left padded; the longest reaches position 95
    real = mask.bool()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        plain = model(ids, mask)
        with on_kernels(model):
            invariant = model(ids, mask)
    torch.testing.assert_close(plain[real], expected[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(invariant[real], expected[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(plain.argmax(-1)[real], expected.argmax(-1)[real])


@pytest.mark.parametrize("variant", ["llama3", "longrope"])
def test_save_model_keeps_the_scaling_for_transformers(variant, tmp_path):
    hf = transformers.LlamaForCausalLM(llama_config(variant)).eval()
    hf.save_pretrained(tmp_path / "hf")
    model, args = load_model(tmp_path / "hf")
    save_model(model, args, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == variant
    assert ModelArgs.from_hf_config(written) == args
    reloaded = transformers.AutoConfig.from_pretrained(tmp_path / "ours")
    assert reloaded.rope_parameters == hf.config.rope_parameters


def test_longrope_positions_stop_at_the_original_length():
    model_args = ModelArgs.from_hf_config(llama_config("longrope").to_dict())
    from reprorl.models.transformer import CausalLM

    assert CausalLM(model_args).model.rope_cos.shape[0] == 128  # max_position_embeddings is 256


@pytest.mark.parametrize("spec,message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic' is not supported \\(it rescales every position"),
    ({"rope_type": "su", "factor": 2.0}, "rope type 'su' is not supported \\(expected one of default, linear"),
    ({"rope_type": "llama3", "factor": 8.0}, "rope type 'llama3' needs low_freq_factor, high_freq_factor, "
                                              "original_max_position_embeddings"),
])
def test_unsupported_rope_is_one_line_naming_the_key(spec, message):
    config = {**json.loads(llama_config("linear").to_json_string()), "rope_parameters": spec, "rope_scaling": None}
    with pytest.raises(ConfigError, match=f"config.json rope_parameters \\(model_type llama\\): {message}"):
        ModelArgs.from_hf_config(config)
