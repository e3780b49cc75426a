"""HF checkpoints: our models against transformers' on the same weights, save/load round
trips through transformers, sharded checkpoints, and the errors for broken directories."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kernel_modes import on_kernels
from padded_batch import padded_batch
from reprorl.models.hf_io import CheckpointError, load_model, save_model
from reprorl.models.transformer import SequenceClassifier, ValueModel

# float32, hidden 64, 2 layers, logits O(1): the two implementations differ by a few ulps.
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,tie", [("qwen2", False), ("qwen2", True), ("qwen3", False), ("llama", False),
                                        ("mistral", False), ("olmo2", False), ("phi3", False),
                                        ("gemma3_text", True), ("mistral-window", False), ("qwen2-window", True)])
@pytest.mark.parametrize("side", ["left", "right"])
def test_causal_lm_matches_transformers(family, tie, side, make_hf_model, tmp_path):
    hf = make_hf_model(family, tie=tie)
    hf.save_pretrained(tmp_path)
    model, args = load_model(tmp_path)
    assert args.model_type == family.removesuffix("-window") and (model.lm_head is None) == tie
    assert any(args.layer_windows) == (family in ("gemma3_text", "mistral-window", "qwen2-window"))
    ids, mask, pos = padded_batch(args.vocab_size, side)
    real = mask.bool()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        plain = model(ids, mask)
        with on_kernels(model):
            invariant = model(ids, mask)
    assert expected[real].abs().max() > 1  # logits are O(1), so the tolerance is tight
    torch.testing.assert_close(plain[real], expected[real], **TOL)
    torch.testing.assert_close(invariant[real], expected[real], **TOL)


@pytest.mark.parametrize("family,tie", [("qwen2", True), ("qwen3", False), ("llama", False), ("mistral", False),
                                        ("olmo2", False), ("phi3", True), ("gemma3_text", True),
                                        ("mistral-window", False), ("qwen2-window", False)])
def test_save_model_loads_in_transformers(family, tie, make_hf_model, tmp_path):
    hf = make_hf_model(family, tie=tie, seed=1)
    hf.save_pretrained(tmp_path / "hf")
    model, args = load_model(tmp_path / "hf")
    save_model(model, args, tmp_path / "ours")
    names = set(load_file(tmp_path / "ours" / "model.safetensors"))
    fused = family == "phi3"  # its checkpoints hold q, k, v as one qkv_proj (models/fused.py)
    assert f"model.layers.0.self_attn.{'qkv_proj' if fused else 'q_proj'}.weight" in names
    assert ("lm_head.weight" in names) == (not tie)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(reloaded) is type(hf)
    ids, mask, pos = padded_batch(args.vocab_size)
    with torch.no_grad():
        # the same weights in the same transformers model: the same bits
        assert torch.equal(
            reloaded(input_ids=ids, attention_mask=mask, position_ids=pos).logits,
            hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits,
        )


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_reward_model_matches_transformers(family, side, make_hf_model, tmp_path):
    hf = make_hf_model(family, kind="reward", seed=2)
    hf.save_pretrained(tmp_path)
    model, args = load_model(tmp_path, kind="reward")
    assert isinstance(model, SequenceClassifier) and args.num_labels == 1
    ids, mask, pos = padded_batch(args.vocab_size, side)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits  # [B, 1]
        torch.testing.assert_close(model(ids, mask), expected, **TOL)
        with on_kernels(model):
            torch.testing.assert_close(model(ids, mask), expected, **TOL)
    save_model(model, args, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__] and config["num_labels"] == 1
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids, attention_mask=mask, position_ids=pos).logits, expected)


def test_critic_matches_token_classification(make_hf_model, tmp_path):
    hf = make_hf_model("qwen3", kind="critic", seed=3)
    hf.save_pretrained(tmp_path)
    model, args = load_model(tmp_path, kind="critic")
    assert isinstance(model, ValueModel)
    ids, mask, pos = padded_batch(args.vocab_size)
    real = mask.bool()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[..., 0]  # [B, T]
        values = model(ids, mask)
    assert values.shape == ids.shape
    torch.testing.assert_close(values[real], expected[real], **TOL)
    save_model(model, args, tmp_path / "ours")
    reloaded = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids, attention_mask=mask, position_ids=pos).logits[..., 0], expected)


def test_critic_starts_from_policy_or_reward(make_hf_model, tmp_path):
    make_hf_model("qwen2", seed=4).save_pretrained(tmp_path / "policy")
    critic, _ = load_model(tmp_path / "policy", kind="critic")
    assert not critic.score.weight.any() and not critic.score.bias.any()  # value 0 everywhere
    policy, _ = load_model(tmp_path / "policy")
    assert torch.equal(critic.model.layers[1].mlp.up_proj.weight, policy.model.layers[1].mlp.up_proj.weight)

    reward_hf = make_hf_model("qwen2", kind="reward", seed=5)
    reward_hf.save_pretrained(tmp_path / "reward")
    critic, _ = load_model(tmp_path / "reward", kind="critic")
    assert torch.equal(critic.score.weight, reward_hf.score.weight) and not critic.score.bias.any()


def test_reward_model_needs_its_head(make_hf_model, tmp_path):
    make_hf_model("qwen2").save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="lacks tensor score.weight"):
        load_model(tmp_path, kind="reward")


def test_sharded_checkpoint(make_hf_model, tmp_path):
    hf = make_hf_model("llama", seed=6)
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    model, args = load_model(tmp_path)
    ids, mask, pos = padded_batch(args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, mask)[mask.bool()],
            hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()],
            **TOL,
        )


def test_dtype_override(make_hf_model, tmp_path):
    make_hf_model("qwen2", seed=7).save_pretrained(tmp_path / "hf")
    model, args = load_model(tmp_path / "hf", dtype=torch.bfloat16)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    ids, mask, _ = padded_batch(args.vocab_size)
    with torch.no_grad():
        assert model(ids, mask).dtype == torch.bfloat16
    save_model(model, args, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16


# ---- writing ---------------------------------------------------------------------------


def test_save_is_atomic_and_leaves_other_files(make_hf_model, tmp_path, monkeypatch):
    make_hf_model("qwen2", seed=8).save_pretrained(tmp_path / "hf")
    model, args = load_model(tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    save_model(model, args, out)
    before = (out / "model.safetensors").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]

    def broken_save(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr("reprorl.models.hf_io.save_file", broken_save)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_model(model, args, out)
    assert (out / "model.safetensors").read_bytes() == before  # the old file is whole
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_save_rejects_other_modules(tmp_path):
    with pytest.raises(TypeError, match="Linear"):
        save_model(torch.nn.Linear(2, 2), None, tmp_path)


# ---- errors ----------------------------------------------------------------------------


@pytest.fixture
def checkpoint(make_hf_model, tmp_path):
    path = tmp_path / "ckpt"
    make_hf_model("qwen2", seed=9).save_pretrained(path)
    return path


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match=f"model path {tmp_path / 'nope'} does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_model(checkpoint)


def test_missing_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no model.safetensors and no model.safetensors.index.json"):
        load_model(checkpoint)


def edit_tensors(checkpoint, edit):
    tensors = load_file(checkpoint / "model.safetensors")
    edit(tensors)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(checkpoint):
    edit_tensors(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"ckpt lacks tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(checkpoint)


def test_unexpected_tensor_is_named(checkpoint):
    edit_tensors(checkpoint, lambda t: t.update({"v_head.summary.weight": torch.zeros(1, 64)}))
    with pytest.raises(CheckpointError, match=r"has tensor v_head\.summary\.weight"):
        load_model(checkpoint)


def test_shape_mismatch_is_named(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["intermediate_size"] = 128
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"tensor model\.layers\.0\.mlp\.gate_proj\.weight in .*ckpt has shape \[160, 64\], expected \[128, 64\]",
    ):
        load_model(checkpoint)


def test_missing_shard(make_hf_model, tmp_path):
    make_hf_model("qwen2").save_pretrained(tmp_path, max_shard_size="60KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {shard.name}, which does not exist"):
        load_model(tmp_path)
