"""LoRA adapters (reprorl/models/lora.py): PEFT's formula on the model's kernels, a
seeded init, the base model with the adapters off, merging, and the target errors."""

import peft
import pytest
import torch
import transformers

from kernel_backends import BACKENDS, INTERPRETED, backend_and_device
from reprorl.models.hf_io import load_model
from reprorl.models.lora import (
    TARGETS, LoraSpec, adapted_linears, adapters_disabled, merged_parameters, merged_state, peft_state,
    resolve_targets,
)
from reprorl.models.transformer import CausalLM

TOL = dict(rtol=1e-5, atol=1e-5)
SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=TARGETS, seed=7)


def batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, :9] = 0
    return ids.masked_fill(mask == 0, 0), mask


def randomize_b(model, seed: int = 1) -> None:
    """lora_B starts at zero (the adapted model is the base); the tests give it values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, linear in adapted_linears(model):
            linear.lora_B.copy_(0.2 * torch.randn(linear.lora_B.shape, generator=g))


@pytest.fixture
def policy_dir(make_hf_model, tmp_path):
    make_hf_model("qwen2").save_pretrained(tmp_path)
    return tmp_path


def test_adapters_match_peft(policy_dir):
    model, args = load_model(policy_dir, lora=SPEC)
    randomize_b(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=SPEC.rank, lora_alpha=SPEC.alpha, target_modules=list(SPEC.target_modules),
                             lora_dropout=0.0)
    hf = peft.get_peft_model(hf, config)
    loaded = peft.set_peft_model_state_dict(hf, peft_state(model))
    assert not loaded.unexpected_keys
    ids, mask = batch(args.vocab_size)
    real = mask.bool()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        ours = model(ids, mask)
        with hf.disable_adapter():
            base_hf = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        with adapters_disabled(model):
            base_ours = model(ids, mask)
    assert (expected[real] - base_hf[real]).abs().max() > 0.1  # the adapters change the logits
    torch.testing.assert_close(ours[real], expected[real], **TOL)
    torch.testing.assert_close(base_ours[real], base_hf[real], **TOL)


def test_adapters_off_is_the_base_bit_for_bit(policy_dir):
    base, args = load_model(policy_dir)
    adapted, _ = load_model(policy_dir, lora=SPEC)
    randomize_b(adapted)
    ids, mask = batch(args.vocab_size)
    with torch.no_grad():
        with adapters_disabled(adapted):
            off = adapted(ids, mask)
        on = adapted(ids, mask)
        expected = base(ids, mask)
    assert torch.equal(off, expected)
    assert not torch.equal(on, expected)
    assert all(m.lora_enabled for _, m in adapted_linears(adapted))  # switched back on after the block


def test_only_adapters_train_and_init_is_seeded(policy_dir):
    a, _ = load_model(policy_dir, lora=SPEC)
    b, _ = load_model(policy_dir, lora=SPEC)
    c, _ = load_model(policy_dir, lora=LoraSpec(4, 8.0, TARGETS, seed=8))
    trainable = [n for n, p in a.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    assert len(trainable) == 2 * len(TARGETS) * a.args.num_hidden_layers
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith(".lora_A"):
            assert not torch.equal(pa, pc), name  # the run seed draws them
            bound = 1 / pa.shape[1] ** 0.5
            assert pa.abs().max() <= bound and pa.abs().max() > 0.5 * bound
        if name.endswith(".lora_B"):
            assert not pa.any()  # zero: the adapted model starts as the base
    q0, q1 = a.model.layers[0].self_attn.q_proj.lora_A, a.model.layers[1].self_attn.q_proj.lora_A
    assert not torch.equal(q0, q1)  # each layer its own draw


def test_merged_state_loads_as_a_plain_model(policy_dir):
    adapted, args = load_model(policy_dir, lora=SPEC)
    randomize_b(adapted)
    plain = CausalLM(args)
    plain.load_state_dict(merged_state(adapted))
    ids, mask = batch(args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids, mask)[mask.bool()], adapted(ids, mask)[mask.bool()], **TOL)


def test_merged_parameters_are_the_plain_models_parameters_with_merged_values(policy_dir):
    """What vLLM's replicas take with LoRA: the plain model's parameters, in its order, the
    adapted weights equal to `merged_state`'s bit for bit, the others the base's own."""
    adapted, args = load_model(policy_dir, lora=SPEC)
    randomize_b(adapted)
    pushed = merged_parameters(adapted)
    assert [n for n, _ in pushed] == [n for n, _ in CausalLM(args).named_parameters()]
    state = merged_state(adapted)
    adapted_names = {f"{name}.weight" for name, _ in adapted_linears(adapted)}
    for name, tensor in pushed:
        assert torch.equal(tensor, state[name]), name
        base = dict(adapted.named_parameters())[name]
        assert torch.equal(tensor, base) != (name in adapted_names), name  # merged exactly where adapted


@pytest.mark.parametrize("name", BACKENDS)
def test_adapted_rows_do_not_depend_on_the_batch(name, policy_dir):
    """The adapters' two products run on the invariant kernels: a sequence's logits are
    the same bits alone as in a padded batch (what keeps the rollout's log-probs the trainer's)."""
    kernels, device = backend_and_device(name)
    if INTERPRETED and kernels.name == "triton":
        pytest.skip("interpreted tl.dot is numpy's matmul, itself not row-invariant; the gpu run checks these bits")
    model, args = load_model(policy_dir, lora=SPEC)
    randomize_b(model)
    model.to(device)
    model.kernels = kernels
    ids, mask = batch(args.vocab_size)
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        together = model(ids, mask)
        for i in range(3):
            n = int(mask[i].sum())
            alone = model(ids[i : i + 1, -n:], mask[i : i + 1, -n:])
            assert torch.equal(alone[0], together[i, -n:]), i


def test_target_errors_name_the_module():
    assert resolve_targets("all-linear") == TARGETS
    assert resolve_targets(["v_proj", "q_proj"]) == ("q_proj", "v_proj")  # model order
    with pytest.raises(ValueError, match="model.target_modules: unknown module 'qkv'"):
        resolve_targets(["q_proj", "qkv"])
    with pytest.raises(ValueError, match="model.target_modules: 'all'"):
        resolve_targets("all")
    with pytest.raises(ValueError, match="empty list"):
        resolve_targets([])
