"""The model shapes the GPU benchmarks run (random weights at the real widths, head layouts,
vocabularies and RoPE), one table for bench/train_step.py and bench/rollout.py.

Each shape is a family (models/tiny.py's TINY_FAMILIES: its switches) and config.json's
values; `shape_args` makes the `ModelArgs`. Gemma 3's layer pattern (five sliding layers,
then a global one) follows the layer count, so `--layers` keeps it.
"""

from __future__ import annotations

import dataclasses

QWEN_05B = {"family": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 151936,
            "max_position_embeddings": 4096, "rope_theta": 1e6}
SHAPES = {
    "0.5b": QWEN_05B,  # Qwen2.5-0.5B
    "1.5b": {**QWEN_05B, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "head_dim": 128},
    "3b": {**QWEN_05B, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
           "num_attention_heads": 16, "head_dim": 128},
    "7b": {**QWEN_05B, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 152064,
           "tie_word_embeddings": False},
    "14b": {**QWEN_05B, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
            "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 152064,
            "tie_word_embeddings": False},
    "32b": {**QWEN_05B, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
            "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 152064,
            "tie_word_embeddings": False},
    "llama3.2-1b": {"family": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                    "max_position_embeddings": 131072, "rope_theta": 5e5,
                    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "gemma3-1b": {"family": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
                  "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
                  "max_position_embeddings": 32768, "rope_theta": 1e6, "local_rope_theta": 1e4,
                  "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256},
}
QUICK = {"family": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 128,
         "max_position_embeddings": 256}


def shape_args(shape: dict, dtype: str = "bfloat16", kind: str = "policy"):
    """The `ModelArgs` of a SHAPES entry (tied embeddings unless it says otherwise)."""
    from reprorl.models.rope import RopeScaling
    from reprorl.models.tiny import tiny_args

    fields = {k: v for k, v in shape.items() if k not in ("family", "sliding_window_pattern")}
    if "rope_scaling" in fields:
        spec = dict(fields["rope_scaling"])
        fields["rope_scaling"] = RopeScaling(spec.pop("rope_type"), tuple(sorted(spec.items())))
    if "sliding_window_pattern" in shape:
        pattern = shape["sliding_window_pattern"]
        fields["layer_types"] = tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(shape["num_hidden_layers"]))
    return dataclasses.replace(tiny_args(kind, shape["family"]), **fields, torch_dtype=dtype)
