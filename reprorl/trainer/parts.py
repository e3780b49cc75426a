"""The parts of a run, built from its config: where they go, its data, its processes.

Parts take plain arguments; the functions here read the config for them:

- `plan_run_placement`: each part's device and GPU share (placement.py);
- `chat_template_kwargs`, `make_datasets`: the chat template's keywords, the train and
  validation sets;
- `policy_loss_args`, `make_kl_controller`: the actor's loss settings, the KL coefficient;
- `start_parts`: the processes, as one `Parts` (the actor, reference and critic worker
  groups, the reward-model and rollout replica pools, the reward loop, the agent-loop
  manager); `Parts.stop` stops them.

`start_parts` starts the processes of all those parts at once and then waits for each; if
one fails, it stops the others before the error propagates.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from reprorl import algos
from reprorl.agent_loop.manager import AgentLoopManager
from reprorl.agent_loop.tools import select_tools, tool_schemas
from reprorl.config import (
    ActorConfig,
    Config,
    DataConfig,
    KLCtrlConfig,
    RewardConfig,
    RolloutConfig,
    reward_fn_name,
)
from reprorl.data.dataset import PromptDataset
from reprorl.data.rewards import REWARD_FNS, check_ground_truth
from reprorl.models.lora import LoraSpec
from reprorl.reward.loop import RewardLoop, WeightedFn
from reprorl.reward.user_fn import resolve_reward_fn
from reprorl.actors.pool import replica_cpus
from reprorl.rollout.replica import ReplicaPool
from reprorl.rollout.request import SamplingParams
from reprorl.actors.supervision import Restarts
from reprorl.resources.placement import Placement, Slot, plan_run, ray_options, reserve_gpus, resolve_device
from reprorl.workers.group import WorkerGroup
from reprorl.workers.optim import OptimArgs
from reprorl.workers.policy import PolicyLossArgs

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ what the run needs


def plan_run_placement(cfg: Config, lora: LoraSpec | None) -> Placement:
    """Each part's GPU and share (placement.py's `plan_run`) on `resources.device`, resolved."""
    return plan_run(cfg, lora=lora is not None, device=resolve_device(cfg.resources.device))


def chat_template_kwargs(data: DataConfig, ro: RolloutConfig) -> dict[str, Any]:
    """The chat template's keywords beyond the messages: `data.apply_chat_template_kwargs`
    and the tool loop's tools, listed for the model as the template lists them (computed
    once a run, for the datasets and the agent loop: a tool file of the user's is executed
    to read its schemas)."""
    tools = {"tools": tool_schemas(select_tools(ro.tools))} if ro.agent_loop == "tool" else {}
    return {**data.apply_chat_template_kwargs, **tools}


def make_datasets(data: DataConfig, rw: RewardConfig, tokenizer: Any, template_kwargs: dict[str, Any]
                  ) -> tuple[PromptDataset, PromptDataset | None]:
    """(train set, validation set or None for `data.val_files=[]`)."""
    # The built-in rule rewards know which sources and ground truths they can ever match: a
    # row that could only score 0 is an error naming it, before the run starts.
    specs = [entry.fn for entry in rw.fns] if rw.fns else [rw.fn]
    builtin_rules = None in specs and (rw.model_path is None or rw.rule_weight != 0)
    def dataset(files: list[str]) -> PromptDataset:
        return PromptDataset(files, tokenizer, data.max_prompt_length, overlong=data.overlong_prompts,
                             prompt_key=data.prompt_key,
                             check_ground_truth=check_ground_truth if builtin_rules else None,
                             known_sources=REWARD_FNS if builtin_rules else None,
                             template_kwargs=template_kwargs)

    return dataset(data.train_files), (dataset(data.val_files) if data.val_files else None)


def policy_loss_args(actor: ActorConfig) -> PolicyLossArgs:
    return PolicyLossArgs(
        policy_loss=actor.policy_loss, clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c, loss_agg_mode=actor.loss_agg_mode,
        entropy_coeff=actor.entropy_coeff, use_kl_loss=actor.use_kl_loss,
        kl_loss_type=actor.kl_loss_type, kl_loss_coef=actor.kl_loss_coef,
        cov=_cov_options(actor),
    )


def _cov_options(actor: ActorConfig) -> dict[str, float] | None:
    """The keywords of `actor.policy_loss` clip_cov or kl_cov (None for the other losses)."""
    keys = algos.POLICY_LOSSES[actor.policy_loss].cov_keywords
    return {key: getattr(actor, key) for key in keys} if keys else None


def make_kl_controller(kl: KLCtrlConfig) -> algos.FixedKLController | algos.AdaptiveKLController:
    if kl.type == "adaptive":
        return algos.AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon)
    return algos.FixedKLController(kl.kl_coef)


# ------------------------------------------------------------------ the processes


@dataclass
class Parts:
    """The processes of a run: each None until it is started, and the reference, critic
    and reward model also when the run has none."""

    actor: WorkerGroup | None = None
    ref: WorkerGroup | None = None
    critic: WorkerGroup | None = None
    reward_model: Any = None  # a RewardModelPool, imported only for a run with one
    pool: ReplicaPool | None = None
    reward_loop: RewardLoop | None = None
    agent: AgentLoopManager | None = None
    gpus: Any = None
    """The Ray placement group that reserves the run's GPUs (placement.py's `reserve_gpus`; None on one GPU or the CPU)."""

    def stop(self) -> None:
        """Stop every part that was started (all of them after `start_parts`; fewer when a
        start failed), then give back the reserved GPUs."""
        if self.reward_loop is not None:
            self.reward_loop.close()
        if self.agent is not None:
            self.agent.shutdown()
        for part in (self.pool, self.actor, self.ref, self.critic, self.reward_model):
            if part is not None:
                part.shutdown()
        if self.gpus is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.gpus)
            self.gpus = None


def start_parts(cfg: Config, *, placement: Placement, lora: LoraSpec | None, restarts: Restarts,
                template_kwargs: dict[str, Any]) -> Parts:
    """Start the processes of every model part at once, then wait for each in turn.

    Each process imports torch (and Triton) and checks its kernels before it answers:
    one part after another, that was most of a short run. The waits go in the order the
    parts used to start (actor, ref, critic, reward model, rollout, the agent loop's
    balancer and workers), so a part that fails
    raises the error it raised alone, naming the part and its rank or replica; the others
    are stopped first (`Parts.stop`). `restarts` is the run's budget of replacements,
    shared by both pools and the agent loop. Ray must be up (`init_ray`).
    """
    t0 = time.perf_counter()
    reward_fn = _reward_fns(cfg.reward)  # a bad reward.fn fails before any process starts
    reward_cpus, rollout_cpus = _replica_cpus(cfg)
    parts = Parts()
    try:
        # Each part is kept as soon as it exists, so that `parts.stop()` finds it if a later one fails.
        parts.gpus = reserve_gpus(placement)
        _start_worker_groups(parts, cfg, placement, lora)
        parts.reward_model = _reward_model(cfg, placement, parts.gpus, restarts, reward_cpus)
        parts.pool = _rollout(cfg, placement, parts.gpus, lora, restarts, rollout_cpus)
        parts.agent = _agent(cfg, parts.pool, template_kwargs)
        # Its rule-reward process starts meanwhile.
        parts.reward_loop = _reward_loop(cfg, reward_fn, parts.reward_model)
        # The agent loop last: a model part that fails raises its error first, as it did
        # when the agent loop started after the others.
        for part in (parts.actor, parts.ref, parts.critic, parts.reward_model, parts.pool, parts.agent):
            if part is not None:
                part.wait_ready()
        logger.info("started %s in %.1f s", _summary(parts, cfg.trainer.num_workers), time.perf_counter() - t0)
    except BaseException:
        parts.stop()  # a part that failed to start stops the others, not only itself
        raise
    return parts


def _summary(parts: Parts, workers: int) -> str:
    """What started, e.g. "actor, ref, 1 reward replica(s), 2 rollout replica(s)"."""
    names = [f"{g.role}" + (f" ({workers} workers)" if workers > 1 else "")
             for g in (parts.actor, parts.ref, parts.critic) if g is not None]
    if parts.reward_model is not None:
        names.append(f"{len(parts.reward_model.replicas)} reward replica(s)")
    names.append(f"{len(parts.pool.replicas)} rollout replica(s)")
    return ", ".join(names)


def _replica_cpus(cfg: Config) -> tuple[float, float]:
    """Ray CPUs per (reward-model replica, rollout replica), counted as if the reward pool
    started first and the rollout pool took its share of what was left (`replica_cpus`):
    Ray counts a replica's CPUs only once it is placed, so pools that start together
    cannot ask Ray what the other one took. The worker groups ask for none."""
    free = ray.available_resources().get("CPU", 0.0)
    reward_cpus = 0.0
    if cfg.reward.model_path is not None:
        reward_cpus = replica_cpus(cfg.reward.num_replicas, free)
        free -= cfg.reward.num_replicas * reward_cpus
    return reward_cpus, replica_cpus(cfg.rollout.num_replicas, free)


def _start_worker_groups(parts: Parts, cfg: Config, placement: Placement, lora: LoraSpec | None) -> None:
    """The actor, the reference (only for a KL term, and not with LoRA) and the critic
    (only for GAE), each a group of `trainer.num_workers` processes: started, not waited
    for. Each is kept in `parts` as it is made, so that a later one's constructor raising
    leaves `parts.stop()` the earlier."""
    total = cfg.trainer.total_steps
    common = {"num_workers": cfg.trainer.num_workers, "seed": cfg.seed, "full_determinism": cfg.full_determinism,
              "dtype": cfg.model.dtype, "device": placement.device,
              "gradient_checkpointing": cfg.model.gradient_checkpointing,
              "gpu_gradient_vectors": cfg.model.gpu_gradient_vectors, "shard_params": cfg.model.shard_params,
              "wait": False,
              "part_timeout_s": cfg.trainer.part_timeout_s}
    # vLLM's replicas serve the plain model: with LoRA they take the merged weights.
    parts.actor = WorkerGroup("actor", model_path=cfg.model.path, optim=_optim_args(cfg.actor, total),
                              lora=lora, push_merged_lora=lora is not None and cfg.rollout.backend == "vllm",
                              optimizer_offload=cfg.actor.optimizer_offload,
                              **common, **_pinned(placement.actor, parts.gpus))
    if placement.ref:  # a KL term without LoRA (placement.plan_run)
        parts.ref = WorkerGroup("ref", model_path=cfg.model.ref_path, optim=None, **common,
                                **_pinned(placement.ref, parts.gpus))
    if placement.critic:  # GAE
        parts.critic = WorkerGroup("critic", model_path=cfg.model.critic_path, optim=_optim_args(cfg.critic, total),
                                   optimizer_offload=cfg.critic.optimizer_offload,
                                   **common, **_pinned(placement.critic, parts.gpus))


def _pinned(slots: tuple[Slot, ...], gpus: Any) -> dict[str, Any]:
    """A group's or pool's keywords that put its processes in their `slots`: the GPU share
    (the same for each) and, with the run's placement group `gpus`, each one's bundle."""
    scheduling = None
    if gpus is not None:
        scheduling = [ray_options(slot, gpus).get("scheduling_strategy") for slot in slots]
    return {"num_gpus": slots[0].share, "scheduling": scheduling}


def _optim_args(section: Any, total_steps: int) -> OptimArgs:
    return OptimArgs(
        lr=section.lr,
        betas=tuple(section.betas),
        weight_decay=section.weight_decay,
        warmup_steps=section.warmup_steps,
        lr_schedule=section.lr_schedule,
        total_steps=total_steps,
        grad_clip=section.grad_clip,
    )


def _reward_model(cfg: Config, placement: Placement, gpus: Any, restarts: Restarts, num_cpus_per_replica: float) -> Any:
    """The reward-model pool, started but not waited for; None without `reward.model_path`."""
    rw = cfg.reward
    if rw.model_path is None:
        return None
    from reprorl.reward.reward_model import RewardModelPool

    return RewardModelPool(
        rw.model_path, rw.num_replicas, seed=cfg.seed, full_determinism=cfg.full_determinism,
        max_num_seqs=rw.max_num_seqs, backend=rw.backend, vllm_options=_vllm_options(cfg.rollout),
        restarts=restarts, num_cpus_per_replica=num_cpus_per_replica, device=placement.device,
        dtype=cfg.model.dtype, **_pinned(placement.reward, gpus), wait=False,
        part_timeout_s=cfg.trainer.part_timeout_s,
    )


def _reward_fns(rw: RewardConfig) -> Any:
    """The rule function of `reward.fn`, or the `WeightedFn`s of `reward.fns`, resolved."""
    batch = rw.reward_manager == "batch"
    if not rw.fns:
        return resolve_reward_fn(rw.fn, batch)
    return [WeightedFn(reward_fn_name(e.fn), resolve_reward_fn(e.fn, batch), e.weight) for e in rw.fns]


def _reward_loop(cfg: Config, reward_fn: Any, reward_model: Any) -> RewardLoop:
    """The reward loop: the rule function(s) `reward_fn` and the reward-model pool, weighted."""
    rw = cfg.reward
    buffer = rw.overlong_buffer
    return RewardLoop(reward_fn, reward_model, rule_weight=rw.rule_weight, model_weight=rw.model_weight,
                      batch=rw.reward_manager == "batch", timeout_s=rw.timeout_s,
                      timeout_is_error=cfg.full_determinism, max_error_rate=rw.max_error_rate,
                      start_timeout_s=cfg.trainer.part_timeout_s, num_workers=rw.num_workers,
                      overlong_buffer=buffer.len if buffer.enable else None,
                      overlong_penalty_factor=buffer.penalty_factor, max_length=cfg.rollout.max_tokens)


def _rollout(cfg: Config, placement: Placement, gpus: Any, lora: LoraSpec | None, restarts: Restarts,
             num_cpus_per_replica: float) -> ReplicaPool:
    """The rollout replica pool, started but not waited for."""
    ro, data = cfg.rollout, cfg.data
    return ReplicaPool(
        cfg.model.path, ro.num_replicas, seed=cfg.seed, full_determinism=cfg.full_determinism,
        max_num_seqs=ro.max_num_seqs, max_num_batched_tokens=ro.max_num_batched_tokens,
        max_model_len=data.max_prompt_length + data.max_response_length,  # within the model's: check_models
        backend=ro.backend, vllm_options=_vllm_options(ro), restarts=restarts,
        num_cpus_per_replica=num_cpus_per_replica, wait=False, part_timeout_s=cfg.trainer.part_timeout_s,
        device=placement.device, dtype=cfg.model.dtype, **_pinned(placement.rollout, gpus),
        native_options={"gpu_memory_utilization": ro.gpu_memory_utilization, "cuda_graphs": ro.cuda_graphs,
                        "prefix_sharing": ro.prefix_sharing, "lookahead": ro.lookahead, "lora": lora},
    )


def _vllm_options(ro: RolloutConfig) -> dict[str, Any]:
    """The rollout section's vllm_* settings as `actors.vllm_engine.engine_kwargs` names them."""
    return {"gpu_memory_utilization": ro.vllm_gpu_memory_utilization, "kv_cache_gib": ro.vllm_kv_cache_gib,
            "enforce_eager": ro.vllm_enforce_eager}


def _agent(cfg: Config, pool: ReplicaPool, template_kwargs: dict[str, Any]) -> AgentLoopManager:
    """The agent-loop manager that sends the rollout pool its requests: its processes
    started, not waited for (`AgentLoopManager.wait_ready`)."""
    ro, data = cfg.rollout, cfg.data
    val_temperature = ro.val.temperature if ro.val.do_sample else 0.0
    return AgentLoopManager(
        pool, ro.num_agent_workers, cfg.model.path,
        max_response_length=data.max_response_length,
        max_prompt_length=data.max_prompt_length,
        sampling_params=_sampling_params(ro.temperature, ro.top_p, ro.top_k, ro.max_tokens),
        val_sampling_params=_sampling_params(val_temperature, ro.val.top_p, ro.val.top_k, ro.max_tokens),
        agent=ro.agent_loop, max_turns=ro.max_turns, routing=ro.routing, tools=ro.tools,
        template_kwargs=template_kwargs,
        part_timeout_s=cfg.trainer.part_timeout_s, wait=False,
    )


def _sampling_params(temperature: float, top_p: float, top_k: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens)
