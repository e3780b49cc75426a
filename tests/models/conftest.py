"""Fixtures for the model tests: random transformers reference models; thread count and
batch-invariant mode restored after each test."""

import pytest
import torch
import transformers


# Small shapes that still exercise GQA (2 query heads per KV head), biases and qk-norm.
SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=10000.0)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, rope_theta=1e6)),
    "llama": (transformers.LlamaConfig, dict(head_dim=16, attention_bias=True, mlp_bias=True, rope_theta=5e5)),
    "mistral": (transformers.MistralConfig, dict(head_dim=32, rope_theta=1e6, sliding_window=None)),
    "olmo2": (transformers.Olmo2Config, dict(rope_theta=5e5)),
    # Phi-4-mini's layout: fused projections, 3/4 of each head rotated, longrope (short factors
    # inside its original length; the batches here are shorter)
    "phi3": (transformers.Phi3Config, dict(
        partial_rotary_factor=0.75, sliding_window=None, original_max_position_embeddings=64,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                      "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]})),
    # Gemma 3's layout: a sliding layer (window 4, its own RoPE base) then a global one with
    # linear scaling (as Gemma 3 4B-27B), and a query_pre_attn_scalar that is not head_dim
    # (as 27B), so the scale's path is exercised
    "gemma3_text": (transformers.Gemma3TextConfig, dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # sliding windows that bind in the test batches (12 tokens): every layer, or qwen's last ones
    "mistral-window": (transformers.MistralConfig, dict(head_dim=32, rope_theta=1e6, sliding_window=4)),
    "qwen2-window": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
}
# transformers' classes whose names are not the config's with the head's suffix
HF_CLASSES = {("gemma3_text", "causal_lm"): "Gemma3ForCausalLM",
              ("gemma3_text", "reward"): "Gemma3TextForSequenceClassification"}
HEADS = {
    "causal_lm": "ForCausalLM",
    "reward": "ForSequenceClassification",
    "critic": "ForTokenClassification",
}


@pytest.fixture
def make_hf_model():
    """make_hf_model(family, kind="causal_lm", tie=False, seed=0) -> a random transformers model.

    Every parameter (biases and norm weights included) is drawn from normal(0, 0.15) around
    its init (norms around 1), so logits are O(1) and a dropped bias or norm would show.
    """

    def make(family: str, kind: str = "causal_lm", tie: bool = False, seed: int = 0):
        config_cls, extra = FAMILIES[family]
        kwargs = dict(SMALL, **extra, tie_word_embeddings=tie, pad_token_id=0, eos_token_id=2)
        if kind != "causal_lm":
            kwargs["num_labels"] = 1
        config = config_cls(**kwargs)
        model_cls = getattr(transformers, HF_CLASSES.get((family, kind))
                            or config_cls.__name__.replace("Config", HEADS[kind]))
        torch.manual_seed(seed)
        model = model_cls(config).eval()
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                base = 1.0 if name.endswith("norm.weight") else 0.0
                param.copy_(base + 0.15 * torch.randn(param.shape, generator=generator))
        return model

    return make


@pytest.fixture(autouse=True)
def one_thread():
    """Model tests run on 1 thread unless they set another count (the thread-invariance
    checks do): on a loaded shared machine OpenMP's waiting threads make tiny ops 10-100x
    slower. The original count comes back afterwards."""
    count = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(count)
