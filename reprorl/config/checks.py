"""Derived values and cross-field checks: `derive` fills in every value that defaults to
another one, `validate` checks what bounds can't express and the values that must agree.
Both run after every key is set and type-checked (loader.py).
"""

from __future__ import annotations

import difflib
import logging
import re

from reprorl.agent_loop.tools import select_tools
from reprorl.algos.registry import ESTIMATORS, POLICY_LOSSES, estimator
from reprorl.config.schema import Config, RolloutConfig, config_keys
from reprorl.errors import ConfigError

logger = logging.getLogger(__name__)


def derive(cfg: Config) -> None:
    """DERIVED VALUES: every value that defaults to another one is filled in here, and only here."""
    if cfg.model.ref_path is None:
        cfg.model.ref_path = cfg.model.path
    if cfg.model.critic_path is None:
        cfg.model.critic_path = cfg.model.path
    if cfg.rollout.max_tokens is None:
        cfg.rollout.max_tokens = cfg.data.max_response_length
    if cfg.critic.ppo_epochs is None:
        cfg.critic.ppo_epochs = cfg.actor.ppo_epochs
    if cfg.critic.ppo_mini_batch_size is None:
        cfg.critic.ppo_mini_batch_size = cfg.actor.ppo_mini_batch_size
    if cfg.critic.ppo_micro_batch_size is None:
        cfg.critic.ppo_micro_batch_size = cfg.actor.ppo_micro_batch_size
    if cfg.critic.ppo_max_token_len_per_micro_batch is None:
        cfg.critic.ppo_max_token_len_per_micro_batch = cfg.actor.ppo_max_token_len_per_micro_batch
    if cfg.trainer.run_dir is None:
        cfg.trainer.run_dir = f"runs/{cfg.trainer.project_name}/{cfg.trainer.experiment_name}"
    # resources.device stays "auto" here, so a config file is portable between machines:
    # the trainer resolves it when the run starts (reprorl/resources/placement.py).


def _check_off_policy(cfg: Config) -> None:
    """`actor.off_policy_correction` with what it can correct (reprorl/algos/rollout_correction.py)."""
    actor = cfg.actor
    mode = actor.off_policy_correction
    if mode == "none":
        return
    if actor.old_log_probs == "rollout":
        raise ConfigError(
            f"actor.off_policy_correction={mode} with actor.old_log_probs=rollout: the correction weighs the "
            "trainer's recomputed log-probs against the engine's; set actor.old_log_probs=auto or recompute"
        )
    if not POLICY_LOSSES[actor.policy_loss].token_weightable:
        usable = ", ".join(name for name, loss in POLICY_LOSSES.items() if loss.token_weightable)
        raise ConfigError(
            f"actor.off_policy_correction={mode} with actor.policy_loss={actor.policy_loss}: the correction weighs "
            f"each token's advantage, which that loss's token selection or sequence advantage would read; use one "
            f"of {usable}"
        )
    lower = actor.rollout_rs_threshold_lower
    if mode == "mis" and lower is not None and lower >= actor.rollout_rs_threshold:
        raise ConfigError(
            f"actor.rollout_rs_threshold_lower={lower} must be below actor.rollout_rs_threshold="
            f"{actor.rollout_rs_threshold}: no token could be kept"
        )


def validate(cfg: Config) -> None:
    """Checks of single values that bounds can't express, then of values that must agree."""
    for key, top_k in (("rollout.top_k", cfg.rollout.top_k), ("rollout.val.top_k", cfg.rollout.val.top_k)):
        if top_k == 0:  # the bound already refuses < -1
            raise ConfigError(f"{key}: expected -1 (off) or an integer >= 1, got {top_k}")
    _check_reward(cfg)
    if cfg.trainer.resume == "":
        raise ConfigError("trainer.resume: expected 'never', 'auto' or a checkpoint path, got ''")
    keys = config_keys()
    leaf_keys = [key for key in keys if not any(other.startswith(key + ".") for other in keys)]  # not sections
    for i, key in enumerate(cfg.trainer.allow_changed_keys):
        if key not in leaf_keys:
            close = difflib.get_close_matches(key, leaf_keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else " (`reprorl config` prints every key)"
            raise ConfigError(f"trainer.allow_changed_keys[{i}]: {key!r} is not a config key{hint}")

    data, rollout, actor, critic, algo = cfg.data, cfg.rollout, cfg.actor, cfg.critic, cfg.algorithm
    if rollout.max_num_batched_tokens < rollout.max_num_seqs:
        raise ConfigError(
            f"rollout.max_num_batched_tokens={rollout.max_num_batched_tokens} must be >= "
            f"rollout.max_num_seqs={rollout.max_num_seqs}: each running sequence decodes one token per forward pass"
        )
    try:
        select_tools(rollout.tools)
    except ValueError as err:
        raise ConfigError(f"rollout.tools: {err}") from None
    if rollout.tools == [] and rollout.agent_loop == "tool":
        raise ConfigError(
            "rollout.tools=[] with rollout.agent_loop=tool: the tool loop needs at least one tool; "
            "name some, or null for all of them"
        )
    if rollout.max_tokens > data.max_response_length:
        raise ConfigError(
            f"rollout.max_tokens={rollout.max_tokens} must be <= data.max_response_length={data.max_response_length}"
        )
    if estimator(algo.adv_estimator).group_based and rollout.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={algo.adv_estimator} compares samples of one prompt: "
            f"it needs rollout.n >= 2, got rollout.n={rollout.n}"
        )
    _check_sampling_varies(rollout, algo.adv_estimator)
    if not algo.norm_adv_by_std and not estimator(algo.adv_estimator).divides_by_group_std:
        raise ConfigError(
            f"algorithm.norm_adv_by_std=false with algorithm.adv_estimator={algo.adv_estimator}: only "
            + " and ".join(e.name for e in ESTIMATORS.values() if e.divides_by_group_std)
            + " read it (whether to divide by the group's std), so it would be ignored; leave it true"
        )
    if POLICY_LOSSES[actor.policy_loss].sequence_advantages and estimator(algo.adv_estimator).token_rewards:
        raise ConfigError(
            f"actor.policy_loss={actor.policy_loss} takes one advantage a sequence, and algorithm.adv_estimator="
            f"{algo.adv_estimator} gives one a token; use an estimator of sequence scores (grpo, rloo, opo, ...)"
        )
    _check_filter_groups(cfg)
    _check_lora(cfg)
    _check_offload(cfg)
    _check_off_policy(cfg)
    if algo.use_kl_in_reward and actor.use_kl_loss:
        raise ConfigError("algorithm.use_kl_in_reward and actor.use_kl_loss are both true: pick one")
    if algo.use_kl_in_reward and estimator(algo.adv_estimator).reward_components:
        raise ConfigError(
            f"algorithm.use_kl_in_reward with algorithm.adv_estimator={algo.adv_estimator}: it normalises each reward "
            "term on its own and the KL penalty is none of them, so it would be ignored; use actor.use_kl_loss"
        )
    batches = [("actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size,
                actor.ppo_max_token_len_per_micro_batch)]
    if estimator(algo.adv_estimator).needs_critic:
        batches.append(("critic", critic.ppo_mini_batch_size, critic.ppo_micro_batch_size,
                        critic.ppo_max_token_len_per_micro_batch))
    for name, mini, micro, max_token_len in batches:
        if data.train_batch_size % mini:
            raise ConfigError(
                f"data.train_batch_size={data.train_batch_size} must be divisible by {name}.ppo_mini_batch_size={mini}"
            )
        if max_token_len is not None:
            _check_token_budget(cfg, name, max_token_len)
            continue
        if (mini * rollout.n) % micro:
            raise ConfigError(
                f"{name}.ppo_mini_batch_size * rollout.n = {mini} * {rollout.n} = {mini * rollout.n} samples "
                f"must be divisible by {name}.ppo_micro_batch_size={micro}"
            )
    _check_num_workers(cfg.trainer.num_workers)


def reward_fn_name(spec: str | None) -> str:
    """The name a rule function's metrics go under: the part of `spec` after its last colon,
    `compute_score` for null (the built-in rewards by data_source)."""
    return "compute_score" if spec is None else spec.rpartition(":")[2]


def _check_reward(cfg: Config) -> None:
    """reward.fn or reward.fns (not both), the way they are called, the overlong buffer."""
    reward = cfg.reward
    specs = [("reward.fn", reward.fn)] + [(f"reward.fns[{i}].fn", entry.fn) for i, entry in enumerate(reward.fns)]
    for key, fn in specs:
        if fn is not None and not re.fullmatch(r"[^:]+:[A-Za-z_][A-Za-z0-9_]*", fn):
            raise ConfigError(f"{key}: expected 'module:function' or 'path.py:function' or null, got {fn!r}")
    if reward.fn is not None and reward.fns:
        raise ConfigError("reward.fn and reward.fns are both set: pick one (reward.fns=[{fn: ..., weight: 1.0}] is "
                          "reward.fn alone)")
    names = [reward_fn_name(entry.fn) for entry in reward.fns]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"reward.fns[{i}].fn={reward.fns[i].fn!r}: a function named {name!r} is already in "
                              f"reward.fns[{names.index(name)}]; each logs its metric reward/<name>/mean under its "
                              "name")
    called = specs[1:] if reward.fns else specs[:1]
    missing = [key for key, fn in called if fn is None]
    if reward.reward_manager == "batch" and missing:
        raise ConfigError(f"{missing[0]}=null with reward.reward_manager=batch: the built-in compute_score scores one "
                          "sample at a time; name a function that takes lists")
    buffer, max_tokens = reward.overlong_buffer, cfg.rollout.max_tokens
    if buffer.enable and not 1 <= buffer.len <= max_tokens:
        raise ConfigError(f"reward.overlong_buffer.len={buffer.len} with reward.overlong_buffer.enable=true: "
                          f"expected 1 <= len <= rollout.max_tokens={max_tokens}")


def _check_filter_groups(cfg: Config) -> None:
    """Dynamic sampling compares the samples of a group, by a metric the run computes."""
    groups, reward = cfg.algorithm.filter_groups, cfg.reward
    if not groups.enable:
        return
    if cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.filter_groups.enable=true with rollout.n={cfg.rollout.n}: a group of one sample "
                          "never varies, so every group would be dropped; expected rollout.n >= 2")
    if groups.metric in ("score", "acc") and reward.model_path is not None and reward.rule_weight == 0:
        raise ConfigError(f"algorithm.filter_groups.metric={groups.metric} reads the rule reward, which does not run "
                          "with reward.rule_weight=0 (a reward model alone); use metric=seq_reward")


def _check_lora(cfg: Config) -> None:
    """LoRA's keys, and what it cannot be combined with (yet)."""
    model = cfg.model
    if model.lora_rank == 0:
        return
    from reprorl.models.lora import resolve_targets  # here: it needs torch, which a plain config does not

    try:
        resolve_targets(model.target_modules)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.rollout.backend == "vllm" and model.shard_params:
        raise ConfigError(
            f"model.shard_params=true with model.lora_rank={model.lora_rank} and rollout.backend=vllm: vLLM's "
            "replicas take the adapters merged into the base weights, and merging needs a layer's weights on one "
            "rank; use model.shard_params=false or rollout.backend=native"
        )
    if model.ref_path != model.path:
        raise ConfigError(
            f"model.ref_path={model.ref_path!r} with model.lora_rank={model.lora_rank}: the reference policy is the "
            "base model with the adapters off; leave model.ref_path null"
        )


def _check_offload(cfg: Config) -> None:
    """optimizer_offload: one GPU per trainable group; with LoRA it moves little."""
    for name, section in (("actor", cfg.actor), ("critic", cfg.critic)):
        if not section.optimizer_offload:
            continue
        if cfg.resources.device == "cuda" and cfg.trainer.num_workers > 1:
            raise ConfigError(
                f"{name}.optimizer_offload=true with trainer.num_workers={cfg.trainer.num_workers} on CUDA: offload "
                "keeps the gradient sums on the host, and their reduction over several GPUs is not built; use "
                "trainer.num_workers=1 or model.shard_params to spread the model instead"
            )
        if name == "actor" and cfg.model.lora_rank:
            logger.warning("actor.optimizer_offload with model.lora_rank=%d: only the adapters have optimizer state, "
                           "a few MiB; offloading it saves nothing worth its copies", cfg.model.lora_rank)


def _check_sampling_varies(rollout: RolloutConfig, adv_estimator: str) -> None:
    """Estimators that compare a sample with others of its prompt (a group, or ReMax's greedy
    baseline) need samples that differ: greedy ones are all alike, so every advantage is 0
    and the run trains on nothing without a word."""
    greedy = [key for key, on in (("rollout.temperature=0", rollout.temperature == 0),
                                  ("rollout.top_k=1", rollout.top_k == 1)) if on]
    if not greedy:
        return
    if estimator(adv_estimator).group_based:
        alike = f"the rollout.n={rollout.n} samples of a prompt are one same response"
    elif estimator(adv_estimator).greedy_baseline:
        alike = "every sample is the greedy response ReMax takes as its baseline"
    else:
        return
    raise ConfigError(
        f"algorithm.adv_estimator={adv_estimator} with {' and '.join(greedy)} (greedy sampling): {alike}, so every "
        "advantage is 0 and nothing is learned; expected rollout.temperature > 0 and rollout.top_k != 1"
    )


def _check_token_budget(cfg: Config, name: str, max_token_len: int) -> None:
    """A token budget must hold the widest sample the data allows."""
    data = cfg.data
    widest = data.max_prompt_length + data.max_response_length
    if max_token_len < widest:
        # The actor is checked first: a critic that inherits its budget fails under the actor's key.
        raise ConfigError(
            f"{name}.ppo_max_token_len_per_micro_batch={max_token_len} must be >= data.max_prompt_length + "
            f"data.max_response_length = {data.max_prompt_length} + {data.max_response_length} = {widest}: the "
            "longest sample must fit in one micro-batch"
        )


def _check_num_workers(num_workers: int) -> None:
    """Each worker sums a block of the leaves of one fixed tree over a mini-batch's
    micro-batches (reprorl/workers/flat.py); the blocks are subtrees of it, whatever the
    micro-batches' count, when the worker count is a power of two."""
    if num_workers & (num_workers - 1):
        raise ConfigError(
            f"trainer.num_workers={num_workers}: expected a power of two (1, 2, 4, 8, ...), so that every allowed "
            "count gives the same bits (reprorl/workers/flat.py)"
        )

