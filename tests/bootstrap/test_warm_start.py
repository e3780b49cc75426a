"""The supervised warm start: loss mask, loss, batch order, training and the saved directory."""

import math

import pytest
import torch
from transformers import AutoTokenizer
from safetensors.torch import load_file

from reprorl.errors import ConfigError
from reprorl.models.hf_io import load_model
from reprorl.bootstrap.warm_start import (
    batch_indices,
    collate,
    sft_example,
    sft_loss,
    sft_train,
    warm_start,
)

# "1+1=" -> "2" in the character tokenizer: specials 0-3 (<|im_start|> 1, <|im_end|> 2),
# "\n" 8, then printable ASCII from 9 (chr(c) -> c - 23).
PROMPT_IDS = (
    [1, 94, 92, 78, 91, 8]  # <|im_start|>user\n
    + [26, 20, 26, 38, 2, 8]  # 1+1=<|im_end|>\n
    + [1, 74, 92, 92, 82, 92, 93, 74, 87, 93, 8]  # <|im_start|>assistant\n
)

PAIRS = [
    ([{"role": "user", "content": f"{a}+{b}="}], str(a + b)) for a in range(4) for b in range(4)
]


def test_sft_example_masks_exactly_the_answer_and_eos(char_tokenizer, tiny_policy_dir):
    ids, mask = sft_example(char_tokenizer, [{"role": "user", "content": "1+1="}], "2")
    assert ids == PROMPT_IDS + [27, 2]  # "2", <|im_end|>
    assert mask == [0] * len(PROMPT_IDS) + [1, 1]

    # The tokenizer read back from a model directory by AutoTokenizer tokenizes the same.
    assert sft_example(AutoTokenizer.from_pretrained(tiny_policy_dir), [{"role": "user", "content": "1+1="}], "2") == (ids, mask)

    ids, mask = sft_example(char_tokenizer, [{"role": "user", "content": "9+9="}], "18")
    assert ids[-3:] == [26, 33, 2]  # "1", "8", <|im_end|>
    assert mask == [0] * (len(ids) - 3) + [1, 1, 1]


def test_collate_right_pads():
    input_ids, attention_mask, loss_mask = collate([([5, 6, 7], [0, 1, 1]), ([9], [1])], pad_token_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert loss_mask.tolist() == [[0, 1, 1], [1, 0, 0]]


def test_sft_loss_hand_computed():
    # V = 2. Position 0 predicts token 1 from uniform logits: -log p = ln 2.
    # Position 1 predicts token 0 from logits [ln 3, 0]: p = 3/4, -log p = ln(4/3).
    # Position 2 predicts nothing (no next token); position 3's target is masked out, so
    # its terrible logits do not count.
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [50.0, -50.0], [7.0, 7.0]]])
    input_ids = torch.tensor([[1, 1, 0, 1]])
    loss_mask = torch.tensor([[0, 1, 1, 0]])
    expected = (math.log(2.0) + math.log(4.0 / 3.0)) / 2
    assert sft_loss(logits, input_ids, loss_mask).item() == pytest.approx(expected, rel=1e-6)

    # With the last token a target too, its -log p = -log_softmax([50, -50])[1] = 100 (+ tiny).
    loss_mask = torch.tensor([[0, 1, 1, 1]])
    expected = (math.log(2.0) + math.log(4.0 / 3.0) + 100.0) / 3
    assert sft_loss(logits, input_ids, loss_mask).item() == pytest.approx(expected, rel=1e-6)


def test_batch_indices_cover_each_epoch_and_follow_the_seed():
    batches = batch_indices(num_examples=10, batch_size=4, steps=5, seed=3)
    flat = [i for batch in batches for i in batch]
    assert [len(b) for b in batches] == [4] * 5
    assert sorted(flat[:10]) == list(range(10))  # epoch 1: every example once
    assert sorted(flat[10:20]) == list(range(10))  # epoch 2, crossing batch boundaries
    assert batch_indices(10, 4, 5, seed=3) == batches
    assert batch_indices(10, 4, 5, seed=4) != batches


def test_sft_train_lowers_the_loss(tiny_policy_dir, char_tokenizer):
    model, _ = load_model(tiny_policy_dir)
    examples = [sft_example(char_tokenizer, messages, answer) for messages, answer in PAIRS]
    losses = sft_train(model, examples, steps=40, batch_size=8, lr=3e-3, seed=0, pad_token_id=0, log_every=0)
    assert len(losses) == 40
    # A random 128-way model starts near ln(128) = 4.85 per token.
    assert losses[0] > 3.5
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]


def test_warm_start_is_byte_identical_for_a_seed(tiny_policy_dir, tmp_path, char_tokenizer):
    kwargs = dict(steps=6, batch_size=4, lr=1e-3, seed=7, log_every=0)
    first = warm_start(tiny_policy_dir, tmp_path / "a", PAIRS, **kwargs)
    second = warm_start(tiny_policy_dir, tmp_path / "b", PAIRS, **kwargs)
    names = sorted(p.name for p in first.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    for name in ("tokenizer.json", "tokenizer_config.json"):  # copied unchanged
        assert (first / name).read_bytes() == (tiny_policy_dir / name).read_bytes(), name

    # The saved weights are the trained ones, and they did move.
    model, _ = load_model(tiny_policy_dir)
    examples = [sft_example(char_tokenizer, messages, answer) for messages, answer in PAIRS]
    sft_train(model, examples, steps=6, batch_size=4, lr=1e-3, seed=7, pad_token_id=0, log_every=0)
    saved = load_file(first / "model.safetensors")
    initial = load_file(tiny_policy_dir / "model.safetensors")
    for name, param in model.state_dict().items():
        assert torch.equal(saved[name], param), name
        assert not torch.equal(saved[name], initial[name]), name

    other = warm_start(tiny_policy_dir, tmp_path / "c", PAIRS, **{**kwargs, "seed": 8})
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()


def test_warm_start_replaces_an_existing_directory(tiny_policy_dir, tmp_path):
    out = tmp_path / "warm"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier run")
    warm_start(tiny_policy_dir, out, PAIRS, steps=1, batch_size=2, lr=1e-3, seed=0, log_every=0)
    assert not (out / "stale.txt").exists()
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["warm"]  # no temp or old dirs left
    load_model(out)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"steps": 0}, "steps=0"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"lr": 0.0}, "lr=0.0"),
    ],
)
def test_warm_start_rejects_bad_arguments(tiny_policy_dir, tmp_path, kwargs, key):
    args = {"steps": 1, "batch_size": 2, "lr": 1e-3, "seed": 0, **kwargs}
    with pytest.raises(ConfigError, match=key):
        warm_start(tiny_policy_dir, tmp_path / "warm", PAIRS, **args)
    with pytest.raises(ConfigError, match="pairs is empty"):
        warm_start(tiny_policy_dir, tmp_path / "warm", [], steps=1, batch_size=2, lr=1e-3, seed=0)
