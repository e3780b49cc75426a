"""make_tiny: the same bytes from the same seed, loadable by transformers and by load_model."""

import json

import pytest
import torch
import transformers

from reprorl.cli import main
from reprorl.errors import ConfigError
from reprorl.models.hf_io import load_model
from reprorl.models.tiny import make_tiny

FILES = ["chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def file_bytes(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("kind", ["policy", "reward"])
def test_same_seed_same_bytes(kind, tmp_path):
    first = make_tiny(tmp_path / "a", kind=kind, seed=3)
    second = make_tiny(tmp_path / "b", kind=kind, seed=3)
    assert sorted(file_bytes(first)) == FILES
    assert file_bytes(first) == file_bytes(second)
    other = file_bytes(make_tiny(tmp_path / "c", kind=kind, seed=4))
    assert other["model.safetensors"] != file_bytes(first)["model.safetensors"]
    assert other["config.json"] == file_bytes(first)["config.json"]


def test_rerun_overwrites(tmp_path):
    out = make_tiny(tmp_path / "m", seed=1)
    (out / "model.safetensors").write_bytes(b"stale")
    make_tiny(out, seed=1)
    assert file_bytes(out) == file_bytes(make_tiny(tmp_path / "fresh", seed=1))


def test_policy_loads_in_transformers_and_matches_ours(tmp_path, char_tokenizer):
    out = make_tiny(tmp_path / "policy", seed=0)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (128, 2, 2)
    assert (config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (1, 64, 128)
    assert config["tie_word_embeddings"] and config["max_position_embeddings"] == 2048

    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True
    )
    assert text == char_tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    model, args = load_model(out)
    assert args.eos_token_id == tokenizer.eos_token_id == 2 and args.pad_token_id == tokenizer.pad_token_id == 0
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-6)
    # normal(0, 0.02) weights, norms at 1.
    assert abs(model.model.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 2e-3
    assert torch.equal(model.model.norm.weight, torch.ones(128))


def test_reward_loads_in_transformers(tmp_path):
    out = make_tiny(tmp_path / "rm", kind="reward", seed=0)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == 0
    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]])
    mask = (ids != 0).long()
    model, _ = load_model(out, kind="reward")
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        torch.testing.assert_close(model(ids, mask), expected, rtol=1e-5, atol=1e-6)


def test_unknown_kind(tmp_path):
    with pytest.raises(ConfigError, match="'critic'"):
        make_tiny(tmp_path, kind="critic")


def test_cli_make_tiny(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "cli"), "--kind", "reward", "--seed", "5"]) == 0
    assert "wrote tiny qwen2 reward model" in capsys.readouterr().out
    assert file_bytes(tmp_path / "cli") == file_bytes(make_tiny(tmp_path / "direct", kind="reward", seed=5))
    assert main(["make-tiny", str(tmp_path / "gemma"), "--family", "gemma3_text"]) == 0
    assert json.loads((tmp_path / "gemma" / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    assert main(["make-tiny", str(tmp_path / "x"), "--family", "gemma2"]) != 0
    assert "tiny model family 'gemma2' is not supported; expected one of" in capsys.readouterr().err
