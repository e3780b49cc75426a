"""The registry (reprorl/algos/registry.py) is the one description of the config's choices."""

import dataclasses
import inspect
import typing

import pytest
import torch

from reprorl import algos
from reprorl.algos.registry import ESTIMATORS, POLICY_LOSSES, PolicyLossSettings
from reprorl.config.schema import ActorConfig, AlgorithmConfig


def test_schema_choices_are_the_registry_names():
    hints = typing.get_type_hints(AlgorithmConfig)
    assert typing.get_args(hints["adv_estimator"]) == tuple(ESTIMATORS)
    assert typing.get_args(typing.get_type_hints(ActorConfig)["policy_loss"]) == tuple(POLICY_LOSSES)


def test_every_entry_has_a_function_and_help():
    for name, entry in {**ESTIMATORS, **POLICY_LOSSES}.items():
        assert entry.name == name
        assert callable(entry.fn) and callable(entry.call)
        assert entry.help and "\n" not in entry.help
    for entry in POLICY_LOSSES.values():
        params = inspect.signature(entry.fn).parameters
        assert all(key in params for key in entry.cov_keywords)
        assert all(hasattr(ActorConfig, key) for key in entry.cov_keywords)


def test_only_gae_needs_a_critic_and_remax_alone_has_a_greedy_baseline():
    assert [e.name for e in ESTIMATORS.values() if e.needs_critic] == ["gae"]
    assert [e.name for e in ESTIMATORS.values() if e.greedy_baseline] == ["remax"]
    assert [e.name for e in ESTIMATORS.values() if e.group_based] == [
        "grpo", "rloo", "reinforce_pp_baseline", "grpo_passk", "opo", "gpg", "gdpo"]


def test_every_policy_loss_takes_the_one_signature():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 3, generator=gen)
    new = -torch.rand(2, 3, generator=gen)
    adv = torch.randn(2, 3, generator=gen)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    norms = {"global_num_tokens": mask.sum(), "global_num_seqs": 2, "max_response_length": 3}
    for entry in POLICY_LOSSES.values():
        loss, stats = entry.call(old, new, adv, mask, PolicyLossSettings(), **norms)
        assert loss.dim() == 0 and torch.isfinite(loss)
        assert {"clipfrac", "approx_kl"} <= set(stats)
        # the dispatch by name is the same call
        again, _ = algos.policy_loss(entry.name, old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                     clip_ratio_c=3.0, loss_agg_mode="token-mean", **norms)
        assert torch.equal(loss, again)


def test_gdpo_reads_the_reward_terms_not_the_token_rewards():
    components = torch.tensor([[1.0, 0.2], [0.0, 0.2], [1.0, 0.0], [1.0, 1.0]])  # [B, K]
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    inputs = algos.AdvantageInputs(torch.zeros(4, 2), mask, ["a", "a", "b", "b"], 1.0, 1.0, True,
                                   reward_components=components, component_weights=(1.0, 0.5))
    adv, returns = ESTIMATORS["gdpo"].advantages(inputs)
    assert torch.equal(adv, algos.gdpo_advantages(components.T, [1.0, 0.5], mask, ["a", "a", "b", "b"]))
    assert adv.abs().sum() > 0 and returns is adv
    with pytest.raises(ValueError, match="reward_components is None"):
        ESTIMATORS["gdpo"].advantages(dataclasses.replace(inputs, reward_components=None))
