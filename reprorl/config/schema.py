"""The config's schema: one dataclass per section; `reprorl config` prints them as
examples/default.yaml.

Every field carries its help text and, where it has one, its allowed range in `metadata`;
`Literal[...]` types are the choices.

`seed` and `full_determinism` live at the top level only; every part reads them from
there, so a run has one seed, not one per component.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from reprorl.algos.registry import ESTIMATORS, POLICY_LOSSES


def _field(default: Any, help: str, **bounds: float) -> Any:
    """A config field: its default, its help text and optional bounds (ge, gt, le, lt).

    Lists and mappings get a `default_factory` so that no two configs share one object.
    """
    metadata = {"help": help, **bounds}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _section(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLType = Literal["k1", "k2", "k3", "abs", "k1+", "k2+", "k3+", "abs+"]


@dataclass
class DataConfig:
    train_files: list[str] = _field(
        ["data/arithmetic/train.parquet"], "training prompts: parquet or JSONL files in verl's dataset schema"
    )
    val_files: list[str] = _field(["data/arithmetic/val.parquet"], "validation prompts; [] = no validation")
    prompt_key: str = _field("prompt", "the row field that holds the chat messages of the prompt")
    max_prompt_length: int = _field(64, "longest prompt in tokens, after the chat template", ge=1)
    max_response_length: int = _field(8, "longest response in tokens; sets the trainer's tensor width", ge=1)
    train_batch_size: int = _field(
        16, "prompts per training step (each sampled rollout.n times); with algorithm.filter_groups, the groups "
        "a step trains on and the prompts of each of its generation batches", ge=1
    )
    val_batch_size: int | None = _field(None, "prompts per validation batch; null = the whole validation set", ge=1)
    overlong_prompts: Literal["error", "filter", "truncate_left", "truncate_right"] = _field(
        "error", "what to do with a prompt longer than max_prompt_length: fail naming the row, drop it, or cut it"
    )
    shuffle: bool = _field(True, "shuffle the training prompts each epoch, in an order drawn from the run seed")
    apply_chat_template_kwargs: dict[str, bool | int | float | str] = _field(
        {}, "more keywords of the tokenizer's chat template for every prompt, e.g. {enable_thinking: false} "
        "(Qwen3); {} = none"
    )


@dataclass
class ModelConfig:
    path: str = _field("models/tiny-policy", "the actor (policy) model: a HF-format directory")
    ref_path: str | None = _field(None, "the reference model for KL; null = model.path")
    critic_path: str | None = _field(None, "the critic's initial weights (GAE only); null = model.path")
    dtype: Literal["float32", "bfloat16"] = _field(
        "float32", "dtype of weights and compute in every worker and replica; bfloat16 is mixed precision: "
        "trainable workers keep float32 master weights and AdamW state, and the bf16 weights they compute with "
        "(and push to the replicas) are the cast of the master"
    )
    gradient_checkpointing: bool = _field(
        False, "recompute each decoder layer's activations in the backward pass of the actor and critic (less "
        "memory, about a third more compute; the same bits)"
    )
    lora_rank: int = _field(
        0, "LoRA rank of the actor's adapters; 0 = full fine-tuning. With LoRA the base weights stay frozen (no "
        "master, gradient or optimizer state for them) and the reference policy is the base with the adapters off",
        ge=0,
    )
    lora_alpha: float = _field(16.0, "LoRA alpha: the adapters' output is scaled by lora_alpha / lora_rank", gt=0)
    target_modules: str | list[str] = _field(
        "all-linear", "the projections that get adapters: 'all-linear' or a list of q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj"
    )
    gpu_gradient_vectors: int = _field(
        0, "whole float32 gradient vectors the actor's and critic's micro-batch gradient sums may keep on the GPU: "
        "0 = all of them (up to log2(micro-batches per worker) + 1); k >= 1 = at most k, the sums of 2^k or more "
        "micro-batches waiting in pinned host memory (the same bits; about micro-batches / 2^k PCIe round trips "
        "of a vector per update)", ge=0
    )
    shard_params: bool = _field(
        False, "the actor's, reference's and critic's parameters sharded at rest over trainer.num_workers (ZeRO-3): "
        "each worker keeps 1/N of the weights, gathers a decoder layer's just before its forward and backward pass "
        "and frees them after, and keeps shard-sized gradient sums; the same bits as false, at the cost of the "
        "gathers"
    )


@dataclass
class RolloutValConfig:
    temperature: float = _field(0.0, "validation sampling temperature; 0 = greedy", ge=0)
    top_p: float = _field(1.0, "validation nucleus sampling mass", gt=0, le=1)
    top_k: int = _field(-1, "validation top-k; -1 = off (0 is not allowed)", ge=-1)
    n: int = _field(1, "validation samples per prompt", ge=1)
    do_sample: bool = _field(False, "sample at validation; false = greedy whatever the temperature")


@dataclass
class RolloutConfig:
    backend: Literal["native", "vllm"] = _field("native", "inference engine: the built-in one or vLLM")
    n: int = _field(8, "responses sampled per prompt (GRPO group size)", ge=1)
    temperature: float = _field(
        1.0, "sampling temperature for training rollouts; 0 = greedy (an error with "
        + ", ".join(e.name for e in ESTIMATORS.values() if e.group_based or e.greedy_baseline)
        + ", which compare samples that must differ)", ge=0
    )
    top_p: float = _field(1.0, "nucleus sampling: keep the smallest set of tokens with this mass", gt=0, le=1)
    top_k: int = _field(
        -1, "keep the k most likely tokens; -1 = off (0 is not allowed; 1 is greedy, refused as temperature 0 is)",
        ge=-1
    )
    max_tokens: int | None = _field(
        None, "most new tokens per response; null = data.max_response_length (larger is an error)", ge=1
    )
    num_replicas: int = _field(2, "inference replicas serving rollouts", ge=1)
    max_num_seqs: int = _field(64, "most sequences a replica runs at once", ge=1)
    max_num_batched_tokens: int = _field(
        4096, "most tokens a replica processes in one forward pass; at least max_num_seqs (each running sequence "
        "decodes one token per pass); longer prompts are read in chunks", ge=1
    )
    routing: Literal["least_loaded", "hash"] = _field(
        "least_loaded", "how requests pick a replica; either way results do not depend on it, only speed does"
    )
    agent_loop: Literal["single_turn", "tool"] = _field(
        "single_turn", "one response per prompt, or a multi-turn tool loop"
    )
    num_agent_workers: int = _field(1, "agent-loop workers sending requests to the replicas", ge=1)
    max_turns: int = _field(4, "most assistant turns in the tool loop", ge=1)
    tools: list[str] | None = _field(
        None, "tools the tool loop may call: a built-in by name (calculator; python, a code interpreter in the "
        "sandbox with state per trajectory: docs/code.md), package.module:function, path/to/file.py:function, or "
        "path/to/file.py (its public functions); a function of yours needs type hints and a docstring with an Args: "
        "line per parameter (its JSON schema, which the chat template shows the model, is derived from them); null = "
        "the calculator (python is used only when named); [] = none, an error with agent_loop=tool"
    )
    gpu_memory_utilization: float = _field(
        0.3, "backend=native on a GPU: share of the GPU's free memory at start-up that one replica's KV cache may "
        "take (it takes no more than max_num_seqs sequences of the run's longest length need)", gt=0, le=1
    )
    cuda_graphs: bool = _field(True, "backend=native on a GPU: replay decode steps from CUDA graphs (false = eager)")
    prefix_sharing: bool = _field(
        True, "backend=native: prefill a prompt once for the samples that bring it together (the n of a GRPO group)"
    )
    lookahead: bool = _field(
        True, "backend=native on a GPU with cuda_graphs: launch decode step t+1 from step t's tokens on the device "
        "before reading them back, so the GPU does not wait for the host between steps (same bits either way)"
    )
    vllm_gpu_memory_utilization: float = _field(
        0.3, "backend=vllm: share of accelerator memory per replica for weights and KV cache (CPU: of host memory, "
        "for the KV cache) when vllm_kv_cache_gib is null", gt=0, le=1
    )
    vllm_kv_cache_gib: float | None = _field(
        None, "backend=vllm: KV-cache size per replica in GiB; null = sized by vllm_gpu_memory_utilization", gt=0
    )
    vllm_enforce_eager: bool = _field(
        False, "backend=vllm: run eagerly, without torch.compile and CUDA graphs (faster start, slower steps); "
        "full_determinism on CUDA always runs eagerly"
    )
    val: RolloutValConfig = _section(RolloutValConfig, "sampling parameters for validation")


@dataclass
class WeightedRewardFnConfig:
    fn: str | None = _field(
        None, "a rule reward function, as reward.fn takes it; null = chosen by each row's data_source (compute_score)"
    )
    weight: float = _field(1.0, "its weight in the rule reward")


@dataclass
class OverlongBufferConfig:
    enable: bool = _field(
        False, "DAPO's overlong reward shaping: a response of L tokens (model and tool tokens) longer than M - len, "
        "M = rollout.max_tokens, gets min(-(L - (M - len)) / len * penalty_factor, 0) added to its reward"
    )
    len: int = _field(0, "the buffer: the last this many tokens of rollout.max_tokens are penalised; >= 1 when "
                      "enabled, at most rollout.max_tokens", ge=0)
    penalty_factor: float = _field(0.0, "the penalty of a response that uses all of rollout.max_tokens", ge=0)


@dataclass
class RewardConfig:
    fn: str | None = _field(
        None, "rule reward function: 'module:function' or 'path.py:function'; null = chosen by each row's data_source"
    )
    fns: list[WeightedRewardFnConfig] = _field(
        [], "several rule reward functions instead of reward.fn, each {fn: ..., weight: ...}: the rule reward is the "
        "weighted sum, added in list order; each function's mean is logged as reward/<name>/mean, <name> its "
        "function's name (after the colon; compute_score for null), so no two may share one. [] = reward.fn alone"
    )
    reward_manager: Literal["naive", "batch"] = _field(
        "naive", "how the rule function(s) are called (verl's name): naive = once per sample, as fn(data_source=, "
        "solution_str=, ground_truth=, extra_info=) -> float; batch = once per batch of samples (a step's, or a "
        "validation batch's) with lists, as verl's batch reward manager does: fn(data_sources=, solution_strs=, "
        "ground_truths=, extra_infos=) -> a list of floats in sample order, reward.timeout_s then bounding the "
        "whole call. batch needs user functions (reward.fn or every reward.fns entry set)"
    )
    overlong_buffer: OverlongBufferConfig = _section(OverlongBufferConfig, "DAPO's overlong reward shaping")
    model_path: str | None = _field(None, "a reward model (HF-format directory); null = no reward model")
    backend: Literal["native", "vllm"] = _field(
        "native", "reward-model engine: the built-in scorer or vLLM's pooling path (with rollout.vllm_* settings)"
    )
    num_replicas: int = _field(1, "reward-model replicas", ge=1)
    max_num_seqs: int = _field(64, "most sequences a reward-model replica scores at once", ge=1)
    timeout_s: float | None = _field(
        60.0, "most seconds one call of the rule function may take; the calls then run in a child process, killed "
        "at the limit: with full_determinism the run stops naming the sample (a 0 would depend on timing), without "
        "it the sample scores 0 (metric reward/fn_timeouts); null = no limit, calls run in the trainer's process",
        gt=0,
    )
    num_workers: int = _field(
        1, "rule-reward processes per rule function (with timeout_s set): a batch's samples are cut into this many "
        "contiguous runs scored side by side, the scores put back in sample order, so the count changes no bit; a "
        "process that dies or hangs is replaced and its call run again. Code rewards, which run each response's "
        "program in the sandbox, gain from it (docs/code.md)", ge=1,
    )
    max_error_rate: float = _field(
        0.1, "the largest share of a batch's samples (a step's, or a validation batch's) on which the rule function "
        "may fail (raise, return NaN or time out) and score 0; more stops the run naming the function and its first "
        "error, with the last checkpoint intact; 1 = never stop (the failures are only counted, metric "
        "reward/fn_errors)", ge=0, le=1,
    )
    rule_weight: float = _field(1.0, "weight of the rule reward in the total reward")
    model_weight: float = _field(1.0, "weight of the reward-model score in the total reward")


@dataclass
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = _field("fixed", "a fixed KL coefficient, or one adapted towards target_kl")
    kl_coef: float = _field(0.001, "KL coefficient (the initial one when adaptive)", ge=0)
    target_kl: float = _field(0.1, "adaptive: the KL per step to steer towards", gt=0)
    horizon: int = _field(10000, "adaptive: the horizon of the proportional controller, in samples", ge=1)


@dataclass
class FilterGroupsConfig:
    enable: bool = _field(
        False, "DAPO's dynamic sampling: drop each group (the rollout.n samples of a prompt) whose metric is the "
        "same on every sample (with grpo or rloo its advantages are all 0) and generate more batches of "
        "data.train_batch_size prompts until data.train_batch_size groups are kept; kept groups past that are left "
        "out, their prompts used (as verl). Needs rollout.n >= 2"
    )
    metric: Literal["seq_reward", "score", "acc"] = _field(
        "seq_reward", "what must differ within a group: seq_reward = the reward trained on (rule and model, "
        "weighted, with the overlong penalty; before an in-reward KL); score = the rule reward alone; acc = whether "
        "the rule reward is full credit (>= 1.0, as val/accuracy counts)"
    )
    max_num_gen_batches: int = _field(
        10, "the most generation batches one step may take; a step still short of data.train_batch_size groups "
        "after them stops the run with an error naming this key; 0 = no limit", ge=0
    )


@dataclass
class AlgorithmConfig:
    adv_estimator: Literal["gae", "grpo", "remax", "rloo", "reinforce_pp", "reinforce_pp_baseline", "grpo_passk",
                           "opo", "gpg", "gdpo"] = _field(
        "grpo", "advantage estimator: " + "; ".join(f"{e.name} = {e.help}" for e in ESTIMATORS.values())
    )
    gamma: float = _field(1.0, "discount factor", ge=0, le=1)
    lam: float = _field(1.0, "GAE lambda", ge=0, le=1)
    norm_adv_by_std: bool = _field(
        True, "grpo, grpo_passk: divide advantages by the group's std (false with grpo = Dr. GRPO; verl's "
        "norm_adv_by_std_in_grpo)")
    use_kl_in_reward: bool = _field(
        False, "subtract a KL penalty from the token rewards (exclusive with actor.use_kl_loss)"
    )
    kl_penalty: KLType = _field(
        "k1", "KL estimator for the in-reward penalty: k1, k2, k3 (Schulman's), abs; '+' as in actor.kl_loss_type"
    )
    kl_ctrl: KLCtrlConfig = _section(KLCtrlConfig, "the in-reward KL coefficient")
    filter_groups: FilterGroupsConfig = _section(FilterGroupsConfig, "DAPO's dynamic sampling (verl's names)")


@dataclass
class ActorConfig:
    lr: float = _field(5e-5, "learning rate", gt=0)
    betas: tuple[float, float] = _field((0.9, 0.999), "AdamW betas")
    weight_decay: float = _field(0.01, "AdamW weight decay", ge=0)
    warmup_steps: int = _field(0, "linear warm-up steps of the learning rate", ge=0)
    lr_schedule: Literal["constant", "cosine"] = _field("constant", "learning-rate schedule after warm-up")
    optimizer_offload: bool = _field(
        False, "the actor's float32 master weights, AdamW moments and gradient sums in host memory, the AdamW step on "
        "the host's cores, the GPU keeping the compute-dtype weights and one parameter's gradient at a time: "
        "the same bits as false, for models whose optimizer state does not fit the GPU (one GPU per group; "
        "pointless with LoRA, whose adapters are small)"
    )
    ppo_epochs: int = _field(1, "passes over each step's batch", ge=1)
    ppo_mini_batch_size: int = _field(16, "prompts per optimizer step (times rollout.n samples), as in verl", ge=1)
    ppo_micro_batch_size: int = _field(32, "samples per forward/backward pass (gradient accumulation)", ge=1)
    ppo_max_token_len_per_micro_batch: int | None = _field(
        None, "cut micro-batches by padded tokens instead (rows x longest prompt + longest response after trimming): "
        "samples sorted by length, ties by index, packed greedily up to this many tokens per forward/backward pass "
        "of the actor's update and of the actor's and reference's log-probs; ppo_micro_batch_size is then unused. "
        "At least data.max_prompt_length + data.max_response_length. The bits depend on it as on "
        "ppo_micro_batch_size, never on trainer.num_workers (any power of two is then allowed); null = off", ge=1
    )
    policy_loss: Literal["vanilla", "gspo", "cispo", "clip_cov", "kl_cov", "sapo", "geo_mean", "dppo", "gpg"] = _field(
        "vanilla", "the policy loss (verl's loss_mode): "
        + "; ".join(f"{p.name} = {p.help}" for p in POLICY_LOSSES.values())
        + " (clip_cov's and kl_cov's choices per micro-batch, as verl)"
    )
    clip_cov_ratio: float = _field(0.0002, "clip_cov: the share of a micro-batch's valid tokens that lose their "
                                   "gradient", gt=0, le=1)
    clip_cov_lb: float = _field(1.0, "clip_cov: a token is a candidate when its covariance is above this")
    clip_cov_ub: float = _field(5.0, "clip_cov: ... and below this")
    kl_cov_ratio: float = _field(0.0002, "kl_cov: the share of a micro-batch's valid tokens penalised", gt=0, le=1)
    ppo_kl_coef: float = _field(1.0, "kl_cov: the coefficient of the |log-ratio| penalty", ge=0)
    tau_pos: float = _field(1.0, "sapo: the gate's temperature where the advantage is > 0 (verl's name)", gt=0)
    tau_neg: float = _field(1.05, "sapo: ... where it is <= 0; above tau_pos, negative updates fade sooner", gt=0)
    dppo_mask_low: float = _field(
        0.2, "dppo: a token of advantage <= 0 whose probability fell by more than this leaves the policy gradient "
        "(prime-rl's name)", ge=0)
    dppo_mask_high: float = _field(
        0.2, "dppo: a token of advantage > 0 whose probability rose by more than this leaves it", ge=0)
    adv_tau: float = _field(1.0, "dppo: the policy-gradient term's coefficient (prime-rl's name)", ge=0)
    kl_tau: float = _field(
        1e-3, "dppo: the coefficient of the squared log-ratio to the old policy (not the reference: that is "
        "use_kl_loss)", ge=0)
    clip_ratio_low: float = _field(0.2, "PPO clip: ratio >= 1 - clip_ratio_low", ge=0, lt=1)
    clip_ratio_high: float = _field(0.2, "PPO clip: ratio <= 1 + clip_ratio_high", ge=0)
    # Dual-clip PPO bounds the loss of negative advantages by clip_ratio_c * |A|; at <= 1
    # it would cut below the ordinary clip.
    clip_ratio_c: float = _field(3.0, "dual-clip bound for negative advantages", gt=1)
    loss_agg_mode: LossAggMode = _field("token-mean", "how token losses are reduced to one loss")
    entropy_coeff: float = _field(0.0, "entropy bonus coefficient", ge=0)
    use_kl_loss: bool = _field(True, "add a KL-to-reference loss (exclusive with algorithm.use_kl_in_reward)")
    kl_loss_type: KLType = _field(
        "k3", "KL estimator for the KL loss: k1, k2, k3 (Schulman's), abs; a '+' (k3+) keeps its value with k2's "
        "gradient (straight-through, as verl)"
    )
    kl_loss_coef: float = _field(0.001, "KL loss coefficient", ge=0)
    grad_clip: float = _field(1.0, "clip the gradient's global norm to this", gt=0)
    old_log_probs: Literal["auto", "recompute", "rollout"] = _field(
        "auto", "where the loss's old log-probs come from: recompute = a forward pass of the trainer over the batch "
        "each step; rollout = the engine's own (verl's bypass mode; with the built-in engine under full "
        "determinism they are the trainer's bit for bit, so the run's bits do not change); auto = rollout when "
        "full_determinism=true and rollout.backend=native, or with trainer.max_staleness > 0 (the ratio is then "
        "taken against the policy that generated the batch), else recompute; off_policy_correction tis or mis "
        "needs recompute (auto gives it)"
    )
    off_policy_correction: Literal["none", "tis", "mis"] = _field(
        "none", "correct the loss for a batch generated by another policy (trainer.max_staleness > 0, or an engine "
        "whose numbers are not the trainer's, vLLM): the old log-probs are recomputed by the trainer (the proximal "
        "policy) and each token's loss is weighted by proximal / behaviour (decoupled PPO); tis = that weight "
        "truncated at rollout_is_threshold; mis = tokens whose weight leaves [rollout_rs_threshold_lower, "
        "rollout_rs_threshold] are left out of the loss, the others keep their weight; none = no weight "
        "(reprorl/algos/rollout_correction.py)"
    )
    rollout_is_threshold: float = _field(2.0, "off_policy_correction=tis: the largest IS weight (verl's name)", gt=0)
    rollout_rs_threshold: float = _field(
        2.0, "off_policy_correction=mis: tokens whose IS weight is above this are left out (verl's name)", gt=1)
    rollout_rs_threshold_lower: float | None = _field(
        None, "off_policy_correction=mis: ... and those below this; null = 1 / rollout_rs_threshold", gt=0)
    log_prob_check_freq: int = _field(
        10, "with old log-probs from the rollout: every this many steps, and at the first step of a run or a resume, "
        "the trainer computes them anyway and checks them against the engine's (rollout/log_prob_max_gap); 0 = never "
        "but that first step", ge=0
    )
    mask_truncated: bool = _field(
        False, "leave responses cut at rollout.max_tokens (finish reason 'length') out of the actor's loss: their "
        "tokens are masked out and not counted (DAPO's overlong filtering); they still take part in the advantages"
    )


@dataclass
class CriticConfig:
    lr: float = _field(1e-4, "learning rate", gt=0)
    betas: tuple[float, float] = _field((0.9, 0.999), "AdamW betas")
    weight_decay: float = _field(0.01, "AdamW weight decay", ge=0)
    warmup_steps: int = _field(0, "linear warm-up steps of the learning rate", ge=0)
    lr_schedule: Literal["constant", "cosine"] = _field("constant", "learning-rate schedule after warm-up")
    optimizer_offload: bool = _field(
        False, "the critic's float32 master weights, AdamW moments and gradient sums in host memory, the AdamW step on "
        "the host's cores, the GPU keeping the compute-dtype weights and one parameter's gradient at a time: "
        "the same bits as false, for models whose optimizer state does not fit the GPU (one GPU per group; "
        "pointless with LoRA, whose adapters are small)"
    )
    ppo_epochs: int | None = _field(None, "passes over each step's batch; null = actor.ppo_epochs", ge=1)
    ppo_mini_batch_size: int | None = _field(
        None, "prompts per optimizer step; null = actor.ppo_mini_batch_size", ge=1
    )
    ppo_micro_batch_size: int | None = _field(
        None, "samples per forward/backward pass; null = actor.ppo_micro_batch_size", ge=1
    )
    ppo_max_token_len_per_micro_batch: int | None = _field(
        None, "the critic's token budget per micro-batch (its values and update), as the actor's; "
        "null = actor.ppo_max_token_len_per_micro_batch", ge=1
    )
    loss_agg_mode: LossAggMode = _field("token-mean", "how token losses are reduced to one loss")
    cliprange_value: float = _field(0.5, "clip new values to old values +- this", gt=0)
    grad_clip: float = _field(1.0, "clip the gradient's global norm to this", gt=0)


@dataclass
class TrainerConfig:
    total_steps: int = _field(30, "training steps", ge=1)
    num_workers: int = _field(
        1, "processes in each of the actor, reference and critic worker groups (data parallel, gradient and "
        "optimizer state sharded); a power of two, so that every allowed count gives the same bits",
        ge=1,
    )
    max_staleness: int = _field(
        0, "asynchronous training: the batch of step s is generated with the weights after step max(0, s - 1 - k) "
        "(k this value) while the steps before it train, up to k batches ahead, by a fixed rule so the bits do not "
        "depend on timing (docs/async.md); 0 = synchronous (each batch with the newest weights). With k > 0 a "
        "checkpoint holds the k batches made ahead, and a resume cannot change k", ge=0)
    test_freq: int = _field(10, "validate every this many steps; 0 = never", ge=0)
    save_freq: int = _field(10, "checkpoint every this many steps; 0 = never", ge=0)
    run_dir: str | None = _field(None, "where checkpoints and logs go; null = runs/<project_name>/<experiment_name>")
    loggers: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = _field(["console", "jsonl"], "metric sinks")
    resume: str = _field("auto", "'never', 'auto' (latest checkpoint in run_dir, if any) or a checkpoint path")
    max_ckpt_to_keep: int | None = _field(None, "keep only the newest this many checkpoints; null = keep all", ge=1)
    allow_changed_keys: list[str] = _field(
        [], "config keys that a resume may change although they change the run's results (e.g. [actor.lr]); "
        "without them a resume whose config differs from its checkpoint's in such a key stops, listing them. "
        "Logging, paths, checkpoint cadence, replica and worker counts and time-outs may always change "
        "(reprorl/records/resume_guard.py); every change is recorded in the run directory's history.jsonl"
    )
    # 4: a preemption or lost node is rare within one run, while a part that dies for a
    # reason of its own (an OOM) dies again at once; a resume is exact, so stopping costs time only.
    max_restarts: int = _field(
        4, "dead rollout replicas, reward-model replicas and agent-loop workers replaced per run (a resume "
        "counts anew); one more death stops the run with an error naming the part; 0 = stop at the first", ge=0
    )
    # 600 s: far above any call of the default run (a rollout takes about a second there); a hang
    # is rare, and a part stopped or replaced too late costs time, never bits.
    part_timeout_s: float = _field(
        600.0, "seconds a part may take to answer one call before it counts as hung: a rollout or reward-model "
        "replica, an agent-loop worker or the load balancer is then killed and replaced (within max_restarts; a "
        "hung replica's requests are retried on another, with the same bits); an actor, reference or critic "
        "worker, or the rule-reward process's start, stops the run naming it, the last checkpoint intact. A call "
        "carrying more than a million tokens gets this per million: a rollout counts samples x (max_prompt_length "
        "+ max_response_length), and each of its generate requests gets the whole rollout's limit (it may wait "
        "behind all the others); a log-prob or value pass its batch's tokens, an update those x ppo_epochs", gt=0
    )
    val_before_train: bool = _field(True, "validate once before the first step")
    log_generations: int = _field(
        0, "write this many samples (prompt, response, reward) of each training step and each validation to "
        "generations.jsonl in the run directory, and as a table to TensorBoard and wandb; 0 = none", ge=0)
    project_name: str = _field("reprorl", "project name, for loggers and run_dir")
    experiment_name: str = _field("tiny-grpo", "experiment name, for loggers and run_dir")


@dataclass
class ResourcesConfig:
    device: Literal["auto", "cpu", "cuda"] = _field(
        "auto", "where the actor, reference, critic, reward model and rollout replicas run; auto = cuda when torch "
        "sees a GPU, else cpu (resolved when the run starts; the determinism report shows it)"
    )
    gpu_share_rollout: float = _field(
        0.3, "device=cuda, one GPU shared by every part: the share of it (a Ray GPU fraction) that the rollout "
        "replicas take together, split evenly between them; the trainer's workers (actor, reference, critic) and the "
        "reward-model replicas split what is left evenly, one share each. Ray fractions only place actors: memory "
        "is not capped by them", gt=0, lt=1
    )
    rollout_gpus: int = _field(
        0, "device=cuda: 0 = the rollout replicas share the trainer's GPUs (one trainer rank of each group per GPU, "
        "trainer.num_workers GPUs; each GPU's replicas take gpu_share_rollout of it and sleep while the trainer "
        "updates); N > 0 = N more GPUs of the replicas' own (at least one replica each), after the trainer's", ge=0
    )


@dataclass
class Config:
    seed: int = _field(42, "the run seed: every seed in the run (data order, sampling, init) derives from it", ge=0)
    full_determinism: bool = _field(
        True, "make the whole run reproducible bit for bit (batch-invariant kernels, deterministic algorithms)"
    )
    data: DataConfig = _section(DataConfig, "datasets and lengths")
    model: ModelConfig = _section(ModelConfig, "model checkpoints")
    rollout: RolloutConfig = _section(RolloutConfig, "generation of training and validation responses")
    reward: RewardConfig = _section(RewardConfig, "rule reward functions and reward models")
    algorithm: AlgorithmConfig = _section(AlgorithmConfig, "advantage estimation and in-reward KL")
    actor: ActorConfig = _section(ActorConfig, "policy optimisation")
    critic: CriticConfig = _section(CriticConfig, "value-function optimisation (adv_estimator=gae only)")
    trainer: TrainerConfig = _section(TrainerConfig, "the training loop, logging and checkpoints")
    resources: ResourcesConfig = _section(ResourcesConfig, "devices: where each part of the run is placed")


# ---------------------------------------------------------------------------------------
# Reading the schema: the loader and the checks go through these.
# ---------------------------------------------------------------------------------------


@functools.cache
def config_fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """name -> (field, resolved type) of a config dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


def config_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the config, sections included (e.g. 'rollout', 'rollout.val.top_p')."""
    keys = []
    for name, (_, tp) in config_fields(cls).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(tp):
            keys.extend(config_keys(tp, prefix + name + "."))
    return keys


def field_bounds(f: dataclasses.Field) -> dict[str, float]:
    """A field's bounds (ge, gt, le, lt): its metadata without the help text."""
    return {k: v for k, v in f.metadata.items() if k != "help"}
