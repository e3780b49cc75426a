"""GPU memory of a run, estimated before it starts from the models' config.json and the Config.

On one GPU every part shares it (resources/placement.py), so the estimate is per GPU: the
parts that stay for the whole run (each model's weights in the compute dtype; a trainable
model's float32 master shard and AdamW moments; each rollout replica's weights, which stay
on the GPU while it sleeps), plus, per phase, what that phase adds:

- generation: each replica's KV cache, sized as `rollout/engine_options.py` `gpu_cache_shape` sizes
  it (max_num_seqs slots of the run's longest sequence, rounded up to KEY_BLOCK tokens, plus
  the CUDA graphs' spare slot, unless `gpu_memory_utilization` of the GPU holds fewer);
  the engine sleeps (frees it) before the trainer's passes; with `trainer.max_staleness` > 0
  it generates while they run, so its KV cache is resident instead.
- actor (and critic) optimizer step: the rank's float32 gradient shard, and the norm's and
  AdamW's temporaries of one chunk (`optim.step_in_chunks`).
- actor update (and critic update): the gradient tree's whole float32 vectors
  (`workers/grad_tree.py`: `max_pending` of this rank's micro-batches, or one with
  `model.gpu_gradient_vectors`) and the activations of one micro-batch (`activation_bytes`).

With `model.shard_params` (workers/units.py) a group's rank keeps its shard of the weights
alone (a trainable group's is the master's cast: nothing more with a float32 model, whose
cast is the master), and its passes add the gathered root and head units and one layer (two on
several ranks: the next is prefetched), the units' float32 gradients, and the sums over
rounds in shard-sized vectors instead of whole ones.

With `optimizer_offload` the master, moments and gradient sums are host memory instead
(host_memory.py), estimated and checked beside the GPU's.

The peak is the largest phase, plus a CUDA context per GPU process (`CUDA_CONTEXT_BYTES`).
LoRA (`model.lora_rank` > 0):
the base weights are frozen in the compute dtype with no master, moments or gradient;
only the adapters have them, and there is no reference model (it is the base with the
adapters off). With `model.shard_params` the base is sharded too, gathered with the
adapters' units.

The estimate against measured peaks (bench/train_step.py prints both): docs/performance.md.
Allocator fragmentation is not counted.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reprorl.errors import ConfigError
from reprorl.kernels.shared import KEY_BLOCK
from reprorl.models.arch import ModelArgs
from reprorl.models.lora import resolve_targets
from reprorl.resources.host_memory import check_host_memory, host_available_bytes, largest_parameter, offloaded_parts
from reprorl.resources.placement import Placement, plan_run
from reprorl.workers.flat import FlatLayout
from reprorl.workers.grad_tree import gpu_vectors_held
from reprorl.workers.optim import STEP_CHUNK
from reprorl.workers.units import exchange_slice

GIB = 2**30
FP32 = 4
CUDA_CONTEXT_BYTES = 512 * 2**20
"""A GPU process's CUDA context and torch's kernel images, not counted by torch's allocator
(about 0.5 GiB on an H200 with CUDA 12)."""


def read_model_args(path: str, key: str) -> ModelArgs:
    """The ModelArgs of `path`/config.json; a one-line error naming `key` when it is missing."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ConfigError(f"{key}={path}: no config.json there, so its memory cannot be estimated")
    return ModelArgs.from_hf_config(json.loads(config.read_text()))


# ------------------------------------------------------------------------------ sizes


def linear_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of one decoder layer, by name."""
    h, q, kv, i = args.hidden_size, args.num_attention_heads * args.head_dim, \
        args.num_key_value_heads * args.head_dim, args.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def param_count(args: ModelArgs, head: str = "causal_lm") -> int:
    """Parameters of the model (`reprorl/models/transformer.py`): head "causal_lm" (the LM
    head unless tied), "critic" (a value head [1, H] with bias) or "reward" ([num_labels, H])."""
    shapes = linear_shapes(args)
    q, kv = shapes["q_proj"][1], shapes["k_proj"][1]
    layer = sum(i * o for i, o in shapes.values()) + 2 * args.hidden_size  # + the two norms
    layer += (q + 2 * kv) * args.qkv_bias + args.hidden_size * args.o_bias
    layer += (2 * args.intermediate_size + args.hidden_size) * args.mlp_bias + 2 * args.head_dim * args.qk_norm
    layer += (q + kv) * args.qk_norm_whole  # olmo2's two norms are the same count as pre-norm's two
    layer += 2 * args.hidden_size * args.sandwich_norm  # gemma3: a norm before and after each block
    return args.num_hidden_layers * layer + root_param_count(args, head)


def root_param_count(args: ModelArgs, head: str = "causal_lm") -> int:
    """The parameters outside the decoder layers (`param_count`'s heads): embeddings, final
    norm, the head (tied: none of its own)."""
    return args.vocab_size * args.hidden_size + head_param_count(args, head)


def head_param_count(args: ModelArgs, head: str = "causal_lm") -> int:
    """The parameters after the decoder layers (units.py's head unit): the final norm and
    the head (tied: none of its own)."""
    heads = {"causal_lm": 0 if args.tie_word_embeddings else args.vocab_size * args.hidden_size,
             "critic": args.hidden_size + 1, "reward": args.num_labels * args.hidden_size}
    return args.hidden_size + heads[head]


def lora_param_count(args: ModelArgs, rank: int, target_modules: Any) -> int:
    """Adapter parameters: rank x (in + out) per targeted projection per layer. An unknown
    target is the config's one-line error (`lora.resolve_targets`)."""
    try:
        names = resolve_targets(target_modules)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    shapes = linear_shapes(args)
    return args.num_hidden_layers * sum(rank * sum(shapes[n]) for n in names)


def gathered_layers(world_size: int) -> int:
    """Layers gathered at once with parameters sharded at rest: the running one, and on
    several ranks the next, prefetched (workers/units.py)."""
    return 1 + (world_size > 1)


def gathered_name(world_size: int) -> str:
    return f"gathered weights (root, head and {gathered_layers(world_size)} layer(s))"


def unit_params(args: ModelArgs, head: str, trainable: int, lora: bool) -> tuple[int, int]:
    """(root and head units, one decoder layer) of the trainable parameters, as units.py
    cuts them (with LoRA the adapters, all in the layers)."""
    root = 0 if lora else root_param_count(args, head)
    return root, (trainable - root) // args.num_hidden_layers


def unit_gradient_params(args: ModelArgs, head: str, trainable: int, lora: bool, world_size: int) -> int:
    """Float32 gradient elements the units hold at most in a backward pass (units.py's
    `Exchange`): the unit being sent (the head's first, then each layer's, then the root's,
    the embeddings') and the layer whose backward runs, and the slices received from every
    rank (`exchange_slice` each). The head's is sent before the root's exists."""
    root, layer = unit_params(args, head, trainable, lora)  # root: the root and head units (none with LoRA)
    head_unit = 0 if lora else head_param_count(args, head)
    largest = max(root - head_unit, head_unit, layer)
    received = world_size * exchange_slice(padded_size(trainable, world_size) // world_size)
    return largest + layer + received


def gathered_bytes(args: ModelArgs, head: str, trainable: int, lora: bool, world_size: int, dsize: int) -> int:
    """The weights a pass holds gathered with parameters sharded at rest: the root and head units and
    `gathered_layers`, of the trained weights and (LoRA) of the frozen base cut into the
    same units."""
    sets = [unit_params(args, head, trainable, lora)]
    if lora:
        sets.append(unit_params(args, head, param_count(args, head), False))
    return sum(root + gathered_layers(world_size) * layer for root, layer in sets) * dsize


def padded_size(numel: int, world_size: int) -> int:
    """`FlatLayout.padded` of `numel` trainable elements: whole CHUNKs, the same count on every rank."""
    return FlatLayout((), (), numel, world_size).padded


def kv_cache_bytes(args: ModelArgs, dtype_bytes: int, max_num_seqs: int, max_model_len: int,
                   utilization: float, free_bytes: int | None) -> int:
    """One native replica's GPU KV cache, as `gpu_cache_shape` sizes it from `free_bytes`
    (None: as if max_num_seqs slots fit), the spare slot included."""
    per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * dtype_bytes
    capacity = -(-max_model_len // KEY_BLOCK) * KEY_BLOCK
    slots = max_num_seqs
    if free_bytes is not None:
        slots = min(max_num_seqs, int(utilization * free_bytes) // (capacity * per_token) - 1)
        if slots < 1:  # one shorter slot (and the spare)
            capacity = int(utilization * free_bytes) // (2 * per_token) // KEY_BLOCK * KEY_BLOCK
            slots = 1
    return (slots + 1) * capacity * per_token


def layer_activation_elems(args: ModelArgs, batch_invariant: bool = False) -> int:
    """Elements per token one decoder layer keeps for its backward pass: six H-wide tensors
    (the layer's input, the normed input, the residual sum, its normed copy, and the two
    copies of rows moved to their front for attention), q, k, v and the attention output,
    gate, up and their SwiGLU product (checked against measured peaks: docs/performance.md).
    The batch-invariant kernels keep one more attention output: theirs comes out heads-first,
    so the output projection's input is a copy (the stock kernels' is a view of SDPA's)."""
    h, i = args.hidden_size, args.intermediate_size
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    return 6 * h + (3 if batch_invariant else 2) * q + 2 * kv + 3 * i


def activation_bytes(args: ModelArgs, dtype_bytes: int, rows: int, seq_len: int, response_len: int, *,
                     checkpointing: bool, head: str = "causal_lm", batch_invariant: bool = False) -> int:
    """The peak of one micro-batch of `rows` x `seq_len` tokens, forward and backward, at the
    start of the backward pass: every layer's saved activations (with checkpointing, each
    layer's input only), three H-wide tensors around the backbone (the embedding, the final
    norm's input and output), and the head's output and its gradient: for the LM head the
    logits `[rows, response_len, V]` in the compute dtype, twice (the log-probs kernel keeps
    no float32 copy). With checkpointing, a layer recomputed later needs its whole set, after
    the logits' gradient is freed. (Against measured peaks: docs/performance.md.)"""
    tokens = rows * seq_len
    layer = layer_activation_elems(args, batch_invariant) * dtype_bytes * tokens
    around = 3 * args.hidden_size * dtype_bytes * tokens
    output = rows * response_len * args.vocab_size * dtype_bytes if head == "causal_lm" else tokens * FP32
    if checkpointing:
        return args.num_hidden_layers * args.hidden_size * dtype_bytes * tokens + around + output + max(output, layer)
    return args.num_hidden_layers * layer + around + 2 * output


def forward_bytes(args: ModelArgs, dtype_bytes: int, rows: int, seq_len: int, response_len: int) -> int:
    """One micro-batch's forward without a gradient (log-probs): the logits in the compute
    dtype and two H-wide tensors; a layer's own tensors are freed as it ends."""
    return rows * response_len * args.vocab_size * dtype_bytes + 2 * args.hidden_size * dtype_bytes * rows * seq_len


# ------------------------------------------------------------------------------ the estimate


@dataclass
class MemoryEstimate:
    """Bytes by part: `resident` for the whole run, `phases` what each phase adds to them."""

    resident: dict[str, int] = field(default_factory=dict)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    """Host memory of optimizer offload, for the whole run (host_memory.py)."""
    processes: int = 1
    """GPU processes (a CUDA context each)."""

    def phase_total(self, phase: str) -> int:
        return sum(self.resident.values()) + sum(self.phases[phase].values()) + self.contexts

    @property
    def contexts(self) -> int:
        return self.processes * CUDA_CONTEXT_BYTES

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @property
    def peak(self) -> int:
        return self.phase_total(self.peak_phase)

    def table(self) -> str:
        """The parts in GiB: resident ones, each phase's own, then each phase's total."""
        rows = [("part", "GiB")] + [(name, b) for name, b in self.resident.items()]
        rows.append((f"CUDA contexts ({self.processes} processes)", self.contexts))
        for phase, parts in self.phases.items():
            rows += [(f"{phase}: {name}", b) for name, b in parts.items()]
        for phase in self.phases:
            mark = "  <- peak" if phase == self.peak_phase else ""
            rows.append((f"total during {phase}{mark}", self.phase_total(phase)))
        if self.host:
            rows += [(name, b) for name, b in self.host.items()] + [("total on the host", sum(self.host.values()))]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {b if isinstance(b, str) else f'{b / GIB:8.2f}'}" for name, b in rows)


def lora_settings(model_cfg: Any, lora_rank: int | None = None) -> tuple[int, Any]:
    """(rank, target_modules): `model.lora_rank` (0 = off) and `model.target_modules`;
    `lora_rank` overrides the config's (for what-would-fit)."""
    rank = model_cfg.lora_rank if lora_rank is None else lora_rank
    return int(rank), model_cfg.target_modules


def micro_batch_geometry(mini_samples: int, micro_batch_size: int, max_token_len: int | None,
                         seq_len: int) -> tuple[int, int]:
    """(micro-batches of a mini-batch, rows of the widest one), every sample at full length:
    by `micro_batch_size` samples, or by a token budget (`workers/micro_batches.py`)."""
    rows = micro_batch_size if max_token_len is None else max(1, max_token_len // seq_len)
    rows = min(rows, mini_samples)
    return math.ceil(mini_samples / rows), rows


def gradient_vectors(micro_batches: int, world_size: int, gpu_vectors: int) -> int:
    """Whole float32 gradient vectors a rank's update holds on the GPU at once (grad_tree.py's
    `gpu_vectors_held` of this rank's leaves: the micro-batches are laid on a power of two,
    `flat.tree_leaves`); one more for the exchange between ranks."""
    leaves = max(1 << (micro_batches - 1).bit_length(), world_size)
    return gpu_vectors_held(max(1, leaves // world_size), gpu_vectors) + (world_size > 1)


@dataclass(frozen=True)
class TrainArgs:
    """A trainable group's settings that decide its memory (plain values from the Config)."""

    name: str  # "actor" | "critic"
    mini_samples: int
    micro_batch_size: int
    max_token_len: int | None


def trainable_parts(est: MemoryEstimate, train: TrainArgs, args: ModelArgs, head: str, trainable: int,
                    cfg: Any, lora: bool = False) -> None:
    """A trainable group's master shard and AdamW moments (float32, this rank's share of the
    padded flat vector) into `resident`, and its update phase: gradient vectors and
    activations (with `model.shard_params`, the module doc's parts instead of whole vectors)."""
    world, dsize = cfg.trainer.num_workers, dtype_bytes(cfg.model.dtype)
    shard = padded_size(trainable, world) // world * FP32
    offload = getattr(cfg, train.name).optimizer_offload
    seq, response = cfg.data.max_prompt_length + cfg.data.max_response_length, cfg.data.max_response_length
    count, rows = micro_batch_geometry(train.mini_samples, train.micro_batch_size, train.max_token_len, seq)
    leaves = max(1 << (count - 1).bit_length(), world) // world  # this rank's (rounds with shard_params)
    update = {f"activations ({rows} x {seq} tokens)": activation_bytes(
        args, dsize, rows, seq, response, checkpointing=cfg.model.gradient_checkpointing, head=head,
        batch_invariant=cfg.full_determinism)}
    if cfg.model.shard_params:
        vector = shard
        update[gathered_name(world)] = gathered_bytes(args, head, trainable, lora, world, dsize)
        update["units' gradients (float32: the one sent, the layer computed, the slices received)"] = \
            unit_gradient_params(args, head, trainable, lora, world) * FP32
        vectors, sums = gpu_vectors_held(leaves, cfg.model.gpu_gradient_vectors), "gradient sums over rounds"
    else:
        vector = padded_size(trainable, world) * FP32
        vectors, sums = gradient_vectors(count, world, cfg.model.gpu_gradient_vectors), "gradient sums"
    if offload:  # the state and the sums on the host instead (host_memory.py)
        est.phases[f"{train.name} update"] = update
        offloaded_parts(est.host, est.phases, name=train.name, shard_bytes=shard, vector_bytes=vector,
                        leaves=leaves, largest=largest_parameter(args), dsize=dsize)
        return
    est.resident[f"{train.name} master weights (float32)"] = shard
    est.resident[f"{train.name} AdamW moments (float32)"] = 2 * shard
    est.phases[f"{train.name} update"] = {
        f"{sums} ({vectors} x float32{' shard' if cfg.model.shard_params else ''})": vectors * vector, **update}
    # After the sums: the rank's gradient shard, then the norm's chunk sums and AdamW a chunk
    # at a time (`chunk_sums_of_squares`, `step_in_chunks`: three temporaries at most).
    est.phases[f"{train.name} optimizer step"] = {
        "gradient shard (float32)": shard,
        "the norm's and AdamW's temporaries of a chunk": 3 * min(shard, STEP_CHUNK * FP32)}


def trained_weights(est: MemoryEstimate, name: str, trainable: int, cfg: Any) -> None:
    """A trainable group's weights in the compute dtype: whole on every rank, or with
    `model.shard_params` this rank's shard (none more with float32: the master is it)."""
    dsize = dtype_bytes(cfg.model.dtype)
    if not cfg.model.shard_params:
        est.resident[name] = trainable * dsize
    elif dsize < FP32:
        world = cfg.trainer.num_workers
        est.resident[f"{name} (this rank's shard)"] = padded_size(trainable, world) // world * dsize


def dtype_bytes(name: str) -> int:
    return {"float32": 4, "bfloat16": 2}[name]


def rollout_parts(est: MemoryEstimate, args: ModelArgs, cfg: Any, gpu_total: int | None, replicas: int) -> None:
    """Each of the GPU's `replicas`' weights (resident: they stay on the GPU while it sleeps)
    and, while it generates, its KV cache (`kv_cache_bytes`, from the GPU's size: its free
    memory is not known before the run) and its last step's float32 logits."""
    ro, dsize = cfg.rollout, dtype_bytes(cfg.model.dtype)
    weights = param_count(args) * dsize
    if ro.backend == "vllm":  # vLLM takes its share of the GPU, weights included, or weights + a KV size
        share = int(ro.vllm_kv_cache_gib * GIB) + weights if ro.vllm_kv_cache_gib is not None else (
            int(ro.vllm_gpu_memory_utilization * gpu_total) if gpu_total is not None else weights)
        est.resident[f"rollout: vLLM, {replicas} replica(s)"] = replicas * share
        est.phases["generation"] = {}
        return
    est.resident[f"rollout weights ({replicas} replica(s))"] = replicas * weights
    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    kv = kv_cache_bytes(args, dsize, ro.max_num_seqs, max_len, ro.gpu_memory_utilization, gpu_total)
    generation = {f"KV cache ({replicas} replica(s))": replicas * kv,
                  "engine logits (float32)": replicas * ro.max_num_seqs * args.vocab_size * FP32}
    if cfg.trainer.max_staleness > 0:  # the engines generate while the trainer's passes run: they never sleep
        est.resident.update({f"{name}, generating beside training": size for name, size in generation.items()})
        generation = {}
    est.phases["generation"] = generation


def gpu_plan(cfg: Any, lora_rank: int) -> Placement:
    """The run's placement on GPUs (`placement.plan_run`), whatever this machine has."""
    return plan_run(cfg, lora=lora_rank > 0, device="cuda")


def estimate_memory(cfg: Any, gpu_total: int | None = None, *, lora_rank: int | None = None) -> MemoryEstimate:
    """Each part's GPU memory on the run's first GPU (module doc), reading only the models'
    config.json: one rank of each trainer group, the reward and (colocated) rollout
    replicas it holds, which no other GPU of the run exceeds (`placement.plan_run` deals
    replicas from GPU 0; `estimate_rollout_gpu` is a rollout GPU's own). `gpu_total`: the
    GPU's bytes (sizes the KV cache as the engine would, from the most it could find free;
    None: as if max_num_seqs slots fit). `lora_rank`: instead of the config's `model.lora_rank`."""
    m, dsize = cfg.model, dtype_bytes(cfg.model.dtype)
    rank, targets = lora_settings(m, lora_rank)
    on_gpu = gpu_plan(cfg, rank).parts_on(0)
    actor = read_model_args(m.path, "model.path")
    est = MemoryEstimate()
    total = param_count(actor)
    trainable = lora_param_count(actor, rank, targets) if rank else total
    world = cfg.trainer.num_workers
    if rank and m.shard_params:  # cut into the adapters' units (workers/units.py)
        est.resident["actor weights (frozen base, this rank's shard)"] = padded_size(total, world) // world * dsize
    elif rank:
        est.resident["actor weights (frozen base)"] = total * dsize
    trained_weights(est, "actor weights" if not rank else f"actor LoRA adapters (rank {rank})", trainable, cfg)
    n = cfg.rollout.n
    mini = cfg.actor.ppo_mini_batch_size * n
    trainable_parts(est, TrainArgs("actor", mini, cfg.actor.ppo_micro_batch_size,
                                   cfg.actor.ppo_max_token_len_per_micro_batch), actor, "causal_lm", trainable, cfg,
                    lora=bool(rank))
    seq, response = cfg.data.max_prompt_length + cfg.data.max_response_length, cfg.data.max_response_length
    _, rows = micro_batch_geometry(mini, cfg.actor.ppo_micro_batch_size, cfg.actor.ppo_max_token_len_per_micro_batch,
                                   seq)
    est.phases["log-probs"] = {f"forward ({rows} x {seq} tokens)": forward_bytes(actor, dsize, rows, seq, response)}
    if m.shard_params:
        est.phases["log-probs"][gathered_name(world)] = gathered_bytes(actor, "causal_lm", trainable, bool(rank),
                                                                       world, dsize)
    if "ref" in on_gpu:  # LoRA: the base is the reference, and there is no group
        ref = param_count(read_model_args(m.ref_path or m.path, "model.ref_path"))
        if m.shard_params:  # its passes gather a unit at a time, as the actor's (the log-probs phase)
            est.resident["reference weights (this rank's shard)"] = padded_size(ref, world) // world * dsize
        else:
            est.resident["reference weights"] = ref * dsize
    if "critic" in on_gpu:
        critic_parts(est, read_model_args(m.critic_path or m.path, "model.critic_path"), cfg)
    if "reward" in on_gpu:
        reward, replicas = read_model_args(cfg.reward.model_path, "reward.model_path"), on_gpu["reward"]
        est.resident[f"reward model weights ({replicas} replica(s))"] = replicas * param_count(reward, "reward") * dsize
    if "rollout" in on_gpu:
        rollout_parts(est, actor, cfg, gpu_total, on_gpu["rollout"])
    est.processes = sum(on_gpu.values())
    return est


def estimate_rollout_gpu(cfg: Any, gpu_total: int | None = None) -> MemoryEstimate | None:
    """The first of the rollout replicas' own GPUs (`resources.rollout_gpus` > 0; None when
    they share the trainer's): its replicas' weights and generation phase."""
    if not cfg.resources.rollout_gpus:
        return None
    plan = gpu_plan(cfg, cfg.model.lora_rank)
    replicas = plan.parts_on(len(plan.actor))["rollout"]
    est = MemoryEstimate(processes=replicas)
    rollout_parts(est, read_model_args(cfg.model.path, "model.path"), cfg, gpu_total, replicas)
    return est


def critic_parts(est: MemoryEstimate, args: ModelArgs, cfg: Any) -> None:
    """The critic: its weights, master and moments, and its update (PPO with GAE only)."""
    c, a = cfg.critic, cfg.actor
    total = param_count(args, "critic")
    trained_weights(est, "critic weights", total, cfg)
    mini = (c.ppo_mini_batch_size or a.ppo_mini_batch_size) * cfg.rollout.n
    budget = c.ppo_max_token_len_per_micro_batch or a.ppo_max_token_len_per_micro_batch
    trainable_parts(est, TrainArgs("critic", mini, c.ppo_micro_batch_size or a.ppo_micro_batch_size, budget),
                    args, "critic", total, cfg)


# ------------------------------------------------------------------------------ the check


def replace_key(cfg: Any, key: str, value: Any) -> Any:
    """A copy of `cfg` with the dotted `key` ("section.name") set to `value`."""
    section, name = key.split(".")
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})})


def what_fits(cfg: Any, gpu_total: int) -> list[str]:
    """Changes that would make `cfg` fit `gpu_total` bytes, each alone: the largest smaller
    actor micro-batch that fits, parameters sharded at rest (on several GPUs), gradient
    checkpointing, the most gradient vectors on the GPU that fit (the rest in host memory),
    LoRA (rank 64, when the run is not LoRA already); else all of those together, with one
    gradient vector on the GPU and the largest micro-batch that then fits; else none."""
    lora = 64 if cfg.model.lora_rank == 0 else None  # None: the run is LoRA already

    def fits(c: Any, lora_rank: int | None = None) -> bool:
        return estimate_memory(c, gpu_total, lora_rank=lora_rank).peak <= gpu_total

    found = []
    micro = largest_micro_batch(cfg, fits, start=cfg.actor.ppo_micro_batch_size // 2)
    if micro is not None:
        found.append(f"actor.ppo_micro_batch_size={micro}")
    switches = []  # (key, value) of each switch the run does not use yet
    if not cfg.model.shard_params and cfg.trainer.num_workers > 1:
        switches.append(("model.shard_params", True))
        if fits(replace_key(cfg, *switches[-1])):
            found.append("model.shard_params=true")
    if not cfg.model.gradient_checkpointing:
        switches.append(("model.gradient_checkpointing", True))
        if fits(replace_key(cfg, *switches[-1])):
            found.append("model.gradient_checkpointing=true")
    vectors = cfg.model.gpu_gradient_vectors
    if vectors != 1:
        switches.append(("model.gpu_gradient_vectors", 1))
        fewer = range((vectors or 4) - 1, 0, -1)  # the most that fit: the fewest copies to the host
        k = next((k for k in fewer if fits(replace_key(cfg, "model.gpu_gradient_vectors", k))), None)
        if k is not None:
            found.append(f"model.gpu_gradient_vectors={k}")
    if lora is not None and fits(cfg, lora_rank=lora):
        found.append(f"LoRA (model.lora_rank={lora})")
    if found:
        return found
    together = cfg
    for key, value in switches:
        together = replace_key(together, key, value)
    names = [f"{key}={str(value).lower()}" for key, value in switches]
    names += [f"model.lora_rank={lora}"] if lora is not None else []
    if cfg.actor.ppo_max_token_len_per_micro_batch is not None:  # no micro-batch size to change
        return [" + ".join(names)] if names and fits(together, lora) else []
    micro = largest_micro_batch(together, lambda c: fits(c, lora), start=cfg.actor.ppo_micro_batch_size)
    if micro is None:
        return []
    return [" + ".join(names + ([f"actor.ppo_micro_batch_size={micro}"] if micro < cfg.actor.ppo_micro_batch_size
                                else []))]


def largest_micro_batch(cfg: Any, fits: Any, start: int) -> int | None:
    """The largest of `start`, `start // 2`, ..., 1 as the actor's micro-batch with which
    `fits(cfg)`; None if none does, or if micro-batches are cut by a token budget."""
    if cfg.actor.ppo_max_token_len_per_micro_batch is not None:
        return None
    micro = start
    while micro >= 1:
        if fits(replace_key(cfg, "actor.ppo_micro_batch_size", micro)):
            return micro
        micro //= 2
    return None


def check_gpu_memory(cfg: Any, gpu_total: int) -> MemoryEstimate:
    """Stop a run that cannot fit GPUs of `gpu_total` bytes before anything starts: a
    one-line ConfigError with the estimate, the GPU's size and what would fit. Returns the
    estimate of the trainer's first GPU."""
    rollout = estimate_rollout_gpu(cfg, gpu_total)
    if rollout is not None and rollout.peak > gpu_total:
        raise ConfigError(
            f"GPU memory: a rollout GPU needs about {rollout.peak / GIB:.1f} GiB at its peak and has "
            f"{gpu_total / GIB:.1f} GiB; would fit: more resources.rollout_gpus (fewer replicas each), or a lower "
            "rollout.gpu_memory_utilization (`reprorl config ... --memory` shows each part)")
    est = estimate_memory(cfg, gpu_total)
    check_host_memory(est.host, host_available_bytes(), cfg)
    if est.peak <= gpu_total:
        return est
    fixes = what_fits(cfg, gpu_total)
    hint = f"would fit: {'; '.join(fixes)}" if fixes else "nothing in reach fits (a bigger GPU, or a smaller model)"
    raise ConfigError(
        f"GPU memory: the run needs about {est.peak / GIB:.1f} GiB at its peak ({est.peak_phase}) and the GPU "
        f"has {gpu_total / GIB:.1f} GiB; {hint} (`reprorl config ... --memory` shows each part)")


def memory_report(cfg: Any, gpu_total: int | None) -> str:
    """What `reprorl config ... --memory` prints: the estimate of each kind of GPU the run
    takes (the trainer's first; a rollout GPU's own, if it has any) and, given `gpu_total`
    bytes, whether each fits."""
    plan = gpu_plan(cfg, cfg.model.lora_rank)
    trainer_gpus = len(plan.actor)
    kinds = [(f"GPU 0 of the trainer's {trainer_gpus} ({_named(plan.parts_on(0))})", estimate_memory(cfg, gpu_total))]
    rollout = estimate_rollout_gpu(cfg, gpu_total)
    if rollout is not None:
        kinds.append((f"GPU {trainer_gpus}, the first of the rollout's {plan.num_gpus - trainer_gpus} "
                      f"({_named(plan.parts_on(trainer_gpus))})", rollout))
    lines = [f"GPU memory estimate per GPU ({cfg.model.path}, model.dtype={cfg.model.dtype}): the run takes "
             f"{plan.num_gpus} GPU(s)"]
    for title, est in kinds:
        lines += ["", title, est.table()]
        if gpu_total is not None:
            lines.append(f"{'fits' if est.peak <= gpu_total else 'does NOT fit'} a GPU of {gpu_total / GIB:.1f} GiB")
        available = host_available_bytes()
        if est.host and available is not None:
            fits = sum(est.host.values()) <= available
            lines.append(f"the host's part {'fits' if fits else 'does NOT fit'} its {available / GIB:.1f} GiB available")
    return "\n".join(lines)


def _named(parts: dict[str, int]) -> str:
    """{"actor": 1, "rollout": 2} -> "actor rank, 2 rollout replicas"."""
    what = {"actor": "actor rank", "ref": "reference rank", "critic": "critic rank", "reward": "reward-model replica",
            "rollout": "rollout replica"}
    return ", ".join(f"{what[p]}" if n == 1 else f"{n} {what[p]}s" for p, n in parts.items())


def gpu_total_bytes() -> int:
    """The total memory of the GPU this process sees first (no context is created for it)."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory
