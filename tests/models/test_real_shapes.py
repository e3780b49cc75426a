"""Every family at the widths and head layouts of the checkpoints people fine-tune, against
transformers on the same random weights.

On the CPU (CI): each shape with 2 layers and its vocabulary cut to 4096 rows (a row of the
embedding or the head does the same arithmetic whatever their number); a sliding window
becomes 40 tokens, one sliding layer then one global, so the 96-token batch crosses it. On a CUDA device
(`gpu` marker): the whole depth and vocabulary of the shapes up to 1.2B parameters, and 8 of
the layers of the larger two; float32 on both kernel backends, and bfloat16.

Weights are drawn at each matrix's scale (normal / sqrt(its last dimension), the embedding
too, since it is also the head of the tied shapes; norms around 1, biases 0.1), so every
layer's output and the logits are O(1) at any width, and a dropped bias, norm or scale
would show.
"""

import math

import pytest
import torch
import transformers

from padded_batch import padded_batch
from reprorl.kernels import select_kernels
from reprorl.models.hf_io import load_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 5e5}
PHI4_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
             "short_factor": [1.0 + 0.05 * i for i in range(48)], "long_factor": [1.0 + 0.5 * i for i in range(48)],
             "original_max_position_embeddings": 4096}
# name: (config class, its keyword arguments, layers on a GPU)
SHAPES = {
    "qwen2.5-0.5b": (transformers.Qwen2Config, dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=32768), 24),
    "qwen3-0.6b": (transformers.Qwen3Config, dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=40960), 28),
    "llama3.2-1b": (transformers.LlamaConfig, dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE,
        max_position_embeddings=131072), 16),
    "olmo2-1b": (transformers.Olmo2Config, dict(
        vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        max_position_embeddings=4096), 16),
    "phi4-mini": (transformers.Phi3Config, dict(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, tie_word_embeddings=True, partial_rotary_factor=0.75, rope_parameters=PHI4_ROPE,
        original_max_position_embeddings=4096, max_position_embeddings=131072, sliding_window=None), 8),
    "mistral-7b-v0.3": (transformers.MistralConfig, dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=32768, sliding_window=None), 8),
    "gemma3-1b": (transformers.Gemma3TextConfig, dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        max_position_embeddings=32768), 26),
    "gemma3-4b": (transformers.Gemma3TextConfig, dict(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        max_position_embeddings=131072), 8),
}
# transformers' classes whose names are not the config's with ForCausalLM
CAUSAL_LM = {transformers.Gemma3TextConfig: "Gemma3ForCausalLM"}
CPU_LAYERS, CPU_VOCAB = 2, 4096
TOL = dict(rtol=1e-4, atol=1e-4)  # float32, the bound for every family


def make_model(shape: str, device: str, layers: int, vocab: int | None, seed: int = 0, window: int | None = None):
    """transformers' model of `shape` with `layers` layers; `window`: another sliding window
    (one the test batch is longer than), and then the layers alternate sliding and global, so
    a few of them have both kinds."""
    config_cls, kwargs, _ = SHAPES[shape]
    kwargs = dict(kwargs, num_hidden_layers=layers, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=2)
    if vocab is not None:
        kwargs["vocab_size"] = vocab
    if window is not None and kwargs.get("sliding_window"):
        kwargs["sliding_window"] = window
        kwargs["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
    cls_name = CAUSAL_LM.get(config_cls) or config_cls.__name__.replace("Config", "ForCausalLM")
    with torch.device(device):
        model = getattr(transformers, cls_name)(config_cls(**kwargs))
    g = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=g, device=device)
            if name.endswith("norm.weight"):  # around 1: gemma3 stores 1 + w, so its w around 0
                param.copy_((0 if config_cls is transformers.Gemma3TextConfig else 1) + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[-1]))
    return model.eval()


def compare(expected, got, real):
    """float32 logits within TOL; top-1 the same wherever the reference's best two are
    further apart than the largest difference seen (a closer pair is a coin toss for any
    two implementations)."""
    expected, got = expected[real].float(), got[real].float()
    torch.testing.assert_close(got, expected, **TOL)
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > (got - expected).abs().max()
    assert clear.float().mean() > 0.9
    assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])


def run_both(shape, tmp_path, device, layers, vocab, lengths, window=None):
    hf = make_model(shape, device, layers, vocab, window=window)
    hf.save_pretrained(tmp_path)
    model, args = load_model(tmp_path)
    assert args.model_type == SHAPES[shape][0].model_type
    ids, mask, pos = padded_batch(args.vocab_size, lengths=lengths)  # left padded
    ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    return hf, model.to(device), (ids, mask, pos), expected


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_real_width_matches_transformers_on_the_cpu(shape, tmp_path):
    hf, model, (ids, mask, _), expected = run_both(shape, tmp_path, "cpu", CPU_LAYERS, CPU_VOCAB, (96, 70, 5),
                                                   window=40)
    real = mask.bool()
    assert expected[real].abs().max() > 1
    with torch.no_grad():
        for invariant in (False, True):
            model.kernels = select_kernels("cpu", invariant)
            compare(expected, model(ids, mask), real)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_whole_depth_matches_transformers_on_the_gpu(shape, tmp_path):
    layers = SHAPES[shape][2]
    torch.backends.cuda.matmul.allow_tf32 = False  # transformers' float32 reference in float32
    hf, model, (ids, mask, pos), expected = run_both(shape, tmp_path, "cuda", layers, None, (600, 333, 7))
    real = mask.bool()
    with torch.no_grad():
        for invariant in (False, True):
            model.kernels = select_kernels("cuda", invariant)
            compare(expected, model(ids, mask), real)
        # bfloat16: ours no further from the float32 logits than transformers' own bfloat16
        hf_bf16 = hf.to(torch.bfloat16)(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
        model = model.to(torch.bfloat16)
        ours_bf16 = {}
        for invariant in (False, True):
            model.kernels = select_kernels("cuda", invariant)
            ours_bf16[invariant] = model(ids, mask).float()
    hf_error = (hf_bf16 - expected)[real].abs().mean()
    for invariant, logits in ours_bf16.items():
        error = (logits - expected)[real].abs().mean()
        print(f"{shape} bf16 mean |error| vs float32: ours ({'invariant' if invariant else 'fast'}) "
              f"{error:.4f}, transformers {hf_error:.4f}")
        assert error <= 1.5 * hf_error
