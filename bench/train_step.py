"""One GRPO step on one GPU through reprorl's own parts, split into generation / log-probs / update.

    timeout 300 python3 bench/train_step.py --out bench/results/train_step.json     # one H200
    python3 bench/train_step.py --quick --out /tmp/train_step.json                  # CPU smoke run

The model is shaped like Qwen2.5-0.5B (width 896, 24 layers, 14 query / 2 KV heads, vocab
151,936, tied embeddings) with random weights, bf16, written once to a scratch directory.
The step: 64 prompts x n=8 of 128 random tokens, 256 new tokens each (eos ignored, so
every response has full length), sampled at T=1 from the full distribution by the built-in
engine (`reprorl.rollout.replica.build_engine`); then the actor's log-probs and one update
on the whole batch (one optimizer step, AdamW on float32 master weights; `--mini-batch`: one
per that many samples), by the trainer's
own rank (`reprorl.workers.worker.ShardWorker`, one rank, in this process), 64 samples a
micro-batch (`--micro-batch`; TRL's step below takes 64 completions a micro-batch too; at
16, the H200 sat idle half of each micro-batch while the host launched its kernels). Between the
generation and the weight push the engine sleeps (its KV cache leaves the GPU, its weights
stay), and it takes the new weights device to device from the rank's parameters, as
`reprorl train` on one GPU does through CUDA IPC (reprorl/trainer/weight_sync.py).
`--max-token-len T` cuts micro-batches by token budget
instead of `--micro-batch` samples (reprorl/workers/micro_batches.py); with every response
at full length that measures its overhead only (its gain on mixed lengths: docs/performance.md).

Each mode runs a warm-up step first, of the timed step's shapes (compilation, autotuning, and
the allocator's growth: after a warm-up of 16 new tokens, whichever mode ran first in the
process took 2.95-3.07 s for its update against 1.53-1.62 s run second, H200, 2026-12-02;
most likely the allocator growing inside the timed update),
and is timed on the steps after it (`--timed-steps`, 3): the step of median time is reported
(the warm-up and the one timed step of a run gave "on" generations of 1.26 and 2.16 s, H200,
2026-12-02, for the same 256 engine steps). The JSON is rewritten after each part, so
a run cut short by `timeout` still leaves what it measured. Both modes run: full
determinism on (batch-invariant Triton kernels, deterministic algorithms) and off (stock
torch). Reported per mode: seconds per phase,
the step, tokens/s of generation, peak GPU memory, and the update's MFU: model FLOPs
(6 x matmul parameters x tokens, plus causal attention's 6 x layers x tokens x context x
width, recomputation not counted) over the update time, against `--peak-tflops` (790,
an H200's dense bf16). When `import trl` works, TRL's `GRPOTrainer` runs the same shape
(transformers generate, beta 0, 64 completions a micro-batch, its default sampling
otherwise) and its step time is in the JSON; else the JSON says why it did not run.

CUBLAS_WORKSPACE_CONFIG is set before CUDA starts and ATEN_CPU_CAPABILITY before torch
starts (full determinism needs them then), so the "off" mode runs with them too. Each step also records the engine's counters for its
generation (steps, steps replayed from CUDA graphs, launched ahead, KV slots).

Old log-probs (`--old-log-probs`, as the trainer's `actor.old_log_probs`): with determinism on,
the engine's, which are the trainer's bit for bit; the warm-up step computes the trainer's
anyway and records the gap (as a run's first step does). With determinism off, or with
`--old-log-probs recompute`, the log-prob pass runs every step.

`--profile`: after the timed step, each mode's log-prob pass and update run once more on
the batch's first 4 micro-batches under torch.profiler (bench/profiling.py): kernel time by group, the share
of the wall time the GPU is busy, the top kernels and the top host-side ops, per
micro-batch. Those runs are not in the step's timings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import socket
import tempfile
import time
from pathlib import Path

from reprorl.determinism import ATEN_CPU_CAPABILITY, CUBLAS_WORKSPACE_CONFIG, determinism_env

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
os.environ.setdefault("ATEN_CPU_CAPABILITY", ATEN_CPU_CAPABILITY)  # full determinism pins it before torch starts

import torch  # noqa: E402

from shapes import QUICK, SHAPES, shape_args  # noqa: E402  (bench/shapes.py: the script's folder is on sys.path)

SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (a smoke run, no timings of worth)")
    p.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (64; quick: 2)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (8; quick: 2)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (128; quick: 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per response (256; quick: 4)")
    p.add_argument("--micro-batch", type=int, default=None, help="samples per forward/backward (64; quick: 2)")
    p.add_argument("--max-token-len", type=int, default=None,
                   help="micro-batches by this token budget instead of --micro-batch samples (every response has "
                        "full length here, so this measures the budget's overhead; its gain: docs/performance.md)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b",
                   help="the model shape (random weights): Qwen2.5 0.5b-7b, llama3.2-1b, gemma3-1b")
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on all linear layers, both sides (0: full)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 x rank)")
    p.add_argument("--timed-steps", type=int, default=3, help="steps timed after the warm-up; the median is reported")
    p.add_argument("--modes", default="off,on", help="determinism modes to run, in order: off,on")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute layers in the backward")
    p.add_argument("--gpu-gradient-vectors", type=int, default=0,
                   help="model.gpu_gradient_vectors: at most this many float32 gradient vectors on the GPU (0: all)")
    p.add_argument("--shard-params", action="store_true",
                   help="the rank's parameters sharded at rest (model.shard_params: a layer gathered when it runs)")
    p.add_argument("--optimizer-offload", action="store_true",
                   help="actor.optimizer_offload: master, AdamW moments and gradient sums in host memory, the step "
                        "on the host's cores (reprorl/workers/offload.py)")
    p.add_argument("--mini-batch", type=int, default=None,
                   help="samples per optimizer step (default: the whole batch, one optimizer step a training step)")
    p.add_argument("--skip-trl", action="store_true", help="do not time TRL's GRPOTrainer")
    p.add_argument("--old-log-probs", choices=("auto", "recompute", "rollout"), default="auto",
                   help="as actor.old_log_probs: auto takes the engine's with determinism on (the trainer's bits), "
                        "after checking them against the trainer's in the warm-up step; recompute: the log-prob pass "
                        "every step")
    p.add_argument("--profile", action="store_true", help="profile each mode's log-probs and update (module doc)")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="the GPU's dense bf16 peak, TFLOP/s")
    args = p.parse_args(argv)
    defaults = (2, 2, 8, 4, 2) if args.quick else (64, 8, 128, 256, 64)
    for name, value in zip(("prompts", "n", "prompt_len", "new_tokens", "micro_batch"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device is None:
        args.device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    if args.lora_alpha is None:
        args.lora_alpha = 2.0 * args.lora_rank
    return args


def lora_spec(args: argparse.Namespace):
    """The LoRA of `--lora-rank` on every linear layer (None: full fine-tuning)."""
    from reprorl.models.lora import TARGETS, LoraSpec

    return LoraSpec(args.lora_rank, args.lora_alpha, TARGETS, SEED) if args.lora_rank else None


def memory_estimate(args: argparse.Namespace, model_dir: Path) -> dict:
    """reprorl/resources/memory.py's estimate for the run this step stands for (one replica, one
    rank, no reference: beta 0), in GiB, without the CUDA contexts: the bench's engine and rank
    share one process, and torch's peak counts neither context."""
    from reprorl.config import load_config
    from reprorl.resources.memory import GIB, estimate_memory

    overrides = [f"model.path={model_dir}", "model.dtype=bfloat16", "resources.device=cuda",
                 f"model.gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
                 f"model.lora_rank={args.lora_rank}", f"model.gpu_gradient_vectors={args.gpu_gradient_vectors}",
                 f"data.max_prompt_length={args.prompt_len}",
                 f"data.max_response_length={args.new_tokens}", f"rollout.n={args.n}",
                 f"rollout.max_num_seqs={args.prompts * args.n}",
                 f"actor.ppo_mini_batch_size={(args.mini_batch or args.prompts * args.n) // args.n}",
                 f"data.train_batch_size={args.prompts}", "actor.use_kl_loss=false", "rollout.num_replicas=1",
                 f"actor.optimizer_offload={str(args.optimizer_offload).lower()}"]
    if args.max_token_len is not None:
        overrides.append(f"actor.ppo_max_token_len_per_micro_batch={args.max_token_len}")
    else:
        overrides.append(f"actor.ppo_micro_batch_size={args.micro_batch}")
    if args.lora_rank:
        overrides.append(f"model.lora_alpha={args.lora_alpha}")
    gpu_total = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else None
    est = estimate_memory(load_config(None, overrides), gpu_total)
    return {"peak_gib": (est.peak - est.contexts) / GIB, "peak_phase": est.peak_phase,
            "host_gib": sum(est.host.values()) / GIB,
            "phases_gib": {phase: (est.phase_total(phase) - est.contexts) / GIB for phase in est.phases},
            "table": est.table()}


def make_model_dir(root: Path, shape: dict, dtype: str, device: str) -> Path:
    """A random policy of `shape` (HF directory, the char tokenizer beside it), drawn on
    `device` (a 7B model's weights took 138 s to draw on the host's CPU; their bits do not
    matter here): norms the identity, every other weight normal(0, 0.02)."""
    from reprorl.models.hf_io import save_model
    from reprorl.models.tokenizer import make_char_tokenizer
    from reprorl.models.transformer import CausalLM

    args = shape_args(shape, dtype)
    with torch.device(device):
        model = CausalLM(args).to(getattr(torch, dtype))
    generator = torch.Generator(device).manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(0.0 if args.norm_plus_one else 1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    out = save_model(model.cpu(), args, root / "policy")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the engine sizes its KV cache from the free memory
    make_char_tokenizer().save_pretrained(out)
    return out


def matmul_params(shape: dict) -> int:
    """Parameters that take part in a matmul per token: the layers' projections and the LM head."""
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return shape["num_hidden_layers"] * per_layer + h * shape["vocab_size"]


def update_flops(shape: dict, batch: int, seq: int) -> float:
    tokens = batch * seq
    attention = 6 * shape["num_hidden_layers"] * tokens * seq * shape["num_attention_heads"] * shape["head_dim"]
    return 6.0 * matmul_params(shape) * tokens + attention  # QK^T and AV: 2 x 2 flops, halved by causality, x3


def peak_host_gib() -> float:
    """This process's peak resident host memory so far (Linux's ru_maxrss, KiB), GiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def generate(loop, engine, prompts: list[list[int]], n: int, new_tokens: int, step: int) -> list:
    from reprorl.determinism import stable_hash
    from reprorl.rollout.request import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=new_tokens, ignore_eos=True)

    async def run():
        calls = [engine.generate(f"s{step}-p{i}-r{j}", ids, params, stable_hash(SEED, step, i, j))
                 for i, ids in enumerate(prompts) for j in range(n)]
        return await asyncio.gather(*calls)

    return loop.run_until_complete(run())


def training_batch(prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                   response_mask: torch.Tensor, g: torch.Generator, **extra: torch.Tensor):
    """The trainer's batch of left-padded `prompts` [B, P] and right-padded `responses` [B, R]
    (their masks 1 on real tokens), with an advantage per sample drawn from `g`; `extra`:
    more fields (e.g. rollout_log_probs)."""
    from reprorl.protocol import Batch

    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return Batch({
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "advantages": torch.randn(len(prompts), 1, generator=g).expand(-1, responses.shape[1]) * response_mask,
        **extra,
    })


def rollout_batch(prompts: list[list[int]], n: int, outputs: list, new_tokens: int, pad: int):
    """The trainer's batch of the outputs (prompts all of one length here, responses right-padded)."""
    prompt = torch.tensor([ids for ids in prompts for _ in range(n)])  # [B, P]
    responses = torch.full((len(outputs), new_tokens), pad, dtype=torch.long)
    response_mask = torch.zeros_like(responses)
    rollout_log_probs = torch.zeros(len(outputs), new_tokens)
    for b, out in enumerate(outputs):
        responses[b, : len(out.token_ids)] = torch.tensor(out.token_ids)
        response_mask[b, : len(out.token_ids)] = 1
        rollout_log_probs[b, : len(out.token_ids)] = torch.tensor(out.log_probs)
    g = torch.Generator().manual_seed(SEED)
    return training_batch(prompt, torch.ones_like(prompt), responses, response_mask, g,
                          rollout_log_probs=rollout_log_probs)


def enter_mode(full_determinism: bool) -> dict[str, str]:
    """Put this process in a determinism mode as a worker rank of that mode runs (its
    variables, torch's deterministic algorithms on or off); the variables, for the rank's check."""
    from reprorl.determinism import enable_full_determinism

    env = determinism_env(SEED, full_determinism)
    os.environ.update(env)
    if full_determinism:
        enable_full_determinism(SEED)
    else:
        torch.use_deterministic_algorithms(False)
    return env


def start_rank(model_dir: Path, env: dict[str, str], *, dtype: str, batch_invariant: bool, device: str,
               total_steps: int, **options):
    """The actor's one rank (`ShardWorker`, in this process; AdamW at lr 1e-6), joined to its
    process group of one on a free local port. `options`: more `ShardWorker` keywords."""
    from reprorl.workers.optim import OptimArgs
    from reprorl.workers.worker import ShardWorker

    worker = ShardWorker("actor", 0, 1, str(model_dir), optim=OptimArgs(lr=1e-6, total_steps=total_steps), dtype=dtype,
                         batch_invariant=batch_invariant, seed=SEED, expected_env=env, device=device, **options)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker.join(f"tcp://127.0.0.1:{port}")
    return worker


def run_mode(args: argparse.Namespace, model_dir: Path, shape: dict, full_determinism: bool) -> dict:
    """A warm-up step and `--timed-steps` GRPO steps in one mode; the median timed step as "timed"."""
    from reprorl.rollout.replica import build_engine
    from reprorl.workers.micro_batches import in_sample_order
    from reprorl.workers.policy import PolicyLossArgs

    env = enter_mode(full_determinism)
    device = args.device
    lora = lora_spec(args)
    engine = build_engine(str(model_dir), device=device, dtype="bfloat16", batch_invariant=full_determinism, lora=lora,
                          max_num_seqs=args.prompts * args.n, max_model_len=args.prompt_len + args.new_tokens,
                          max_num_batched_tokens=max(args.prompts * args.n, 8192))
    engine.scheduler.eos_token_ids = frozenset()  # random weights: every response runs to full length
    worker = start_rank(model_dir, env, dtype="bfloat16", batch_invariant=full_determinism, device=device,
                        total_steps=1 + args.timed_steps, gradient_checkpointing=args.gradient_checkpointing, lora=lora,
                        gpu_gradient_vectors=args.gpu_gradient_vectors, shard_params=args.shard_params,
                        optimizer_offload=args.optimizer_offload)
    g = torch.Generator().manual_seed(SEED)
    vocab = shape["vocab_size"]
    samples = args.prompts * args.n
    record: dict = {"full_determinism": full_determinism}
    loop = asyncio.new_event_loop()  # the engine's step loop lives on it, for the whole mode
    try:
        new_tokens = args.new_tokens  # step 1, the warm-up, at the timed step's shapes too (module doc)
        for step in range(1, 2 + args.timed_steps):
            prompts = torch.randint(3, vocab, (args.prompts, args.prompt_len), generator=g).tolist()
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            retries = alloc_retries(device)
            before = engine.stats()
            sync(device)
            t0 = time.perf_counter()
            outputs = generate(loop, engine, prompts, args.n, new_tokens, step)
            sync(device)
            t1 = time.perf_counter()
            after = engine.stats()
            counters = {k: after[k] - before[k] for k in ("steps", "graph_steps", "lookahead_steps", "prefix_shared")}
            counters.update(kv_slots=after["kv_slots"], graph_error=after["graph_error"])
            loop.run_until_complete(engine.sleep(keep_weights=True))
            batch = rollout_batch(prompts, args.n, outputs, new_tokens, pad=0)
            sync(device)
            t2 = time.perf_counter()
            from_rollout = args.old_log_probs == "rollout" or (args.old_log_probs == "auto" and full_determinism)
            gap = None
            if not from_rollout or step == 1:  # the trainer's first step checks them too (actor.log_prob_check_freq)
                rows, log_probs = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=args.micro_batch,
                                                           max_token_len=args.max_token_len)
                batch["old_log_probs"] = in_sample_order(log_probs, rows)
                gap = ((batch["rollout_log_probs"] - batch["old_log_probs"]).abs() * batch["response_mask"]).max().item()
            if from_rollout:
                batch["old_log_probs"] = batch["rollout_log_probs"].clone()
            sync(device)
            t3 = time.perf_counter()
            worker.update(batch, ppo_epochs=1, mini_batch_size=args.mini_batch or samples,
                          micro_batch_size=args.micro_batch, max_token_len=args.max_token_len, max_response_length=new_tokens, loss=PolicyLossArgs(),
                          temperature=1.0)
            sync(device)
            t4 = time.perf_counter()
            weights = worker.pushed_weights()  # copied in place, device to device (with LoRA the adapters alone)
            with worker.at_rest.all_gathered() if worker.at_rest is not None else contextlib.nullcontext():
                loop.run_until_complete(engine.update_weights(weights, version=step))
            loop.run_until_complete(engine.wake_up())
            sync(device)
            t5 = time.perf_counter()
            record[f"step{step}"] = {
                "generation_s": t1 - t0, "sleep_and_batch_s": t2 - t1, "log_probs_s": t3 - t2, "update_s": t4 - t3,
                "weight_sync_and_wake_s": t5 - t4, "step_s": t5 - t0,
                "generation_tok_per_s": samples * new_tokens / (t1 - t0),
                "log_prob_max_gap": gap,
                "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                "peak_host_gib": peak_host_gib(),
                # cudaMalloc failures the caching allocator met by freeing its cache and trying
                # again (slow, synchronizing): a step near the GPU's size pays them
                "alloc_retries": alloc_retries(device) - retries if device == "cuda" else None,
            }
            print(f"  {'on ' if full_determinism else 'off'} step {step}: " + ", ".join(
                f"{k} {v:.3g}" for k, v in record[f"step{step}"].items() if v is not None), flush=True)
            record[f"step{step}"]["engine"] = counters
            print(f"      engine: {counters}", flush=True)
        steps = sorted(range(2, 2 + args.timed_steps), key=lambda i: record[f"step{i}"]["step_s"])
        record["timed_step"] = steps[len(steps) // 2]  # the median (the upper one of an even count)
        record["timed"] = timed = record[f"step{record['timed_step']}"]
        record["old_log_probs"] = "rollout" if from_rollout else "recompute"
        record["log_prob_max_gap"] = record["step1"]["log_prob_max_gap"]  # the warm-up's check, if not every step's
        # The weights after the last step, to compare runs' bits (e.g. with and without --shard-params).
        digests = worker.weight_digests()
        record["weights_sha256"] = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()
        flops = update_flops(shape, samples, args.prompt_len + args.new_tokens)
        record["update_tflops"] = flops / timed["update_s"] / 1e12
        record["update_mfu"] = record["update_tflops"] / args.peak_tflops
        if args.profile:
            record["profile"] = profile_passes(args, worker, batch, samples, new_tokens, full_determinism)
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0.01))  # let the cancelled step loop finish
        worker.shutdown()
        loop.close()
        del engine, worker
        if device == "cuda":
            torch.cuda.empty_cache()
    return record


def alloc_retries(device: str) -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device == "cuda" else 0


def profile_passes(args, worker, batch, samples: int, new_tokens: int, full_determinism: bool,
                   micro_batches: int = 4) -> dict:
    """The log-prob pass and the update once more under torch.profiler, on the batch's first
    `micro_batches` micro-batches (a whole step's trace is millions of events), per micro-batch."""
    from torch.profiler import ProfilerActivity, profile

    from profiling import host_summary, kernel_summary, print_summary
    from reprorl.workers.policy import PolicyLossArgs

    samples = min(samples, micro_batches * args.micro_batch)
    batch = batch.slice(0, samples)
    passes = {
        "log_probs": lambda: worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=args.micro_batch),
        "update": lambda: worker.update(batch, ppo_epochs=1, mini_batch_size=samples, micro_batch_size=args.micro_batch,
                                        max_response_length=new_tokens, loss=PolicyLossArgs(), temperature=1.0),
    }
    micro_batches = math.ceil(samples / args.micro_batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    out = {}
    for name, run in passes.items():
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            run()
            sync(args.device)
            wall = time.perf_counter() - t0
        out[name] = {**kernel_summary(prof, wall, per=micro_batches), "host": host_summary(prof, per=micro_batches)}
        print_summary(f"{'on ' if full_determinism else 'off'} {name}, a micro-batch of {args.micro_batch}",
                      out[name], out[name]["host"])
    return out


def run_trl(args: argparse.Namespace, shape: dict) -> dict:
    """TRL's GRPOTrainer on the same shape (random Qwen2 weights, beta 0): the second step's time."""
    if shape["family"] != "qwen2":
        return {"ran": False, "why": f"TRL is timed at the Qwen2 shapes only, not {shape['family']}"}
    try:
        import trl
        from datasets import Dataset
        from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback
    except ImportError as err:
        return {"ran": False, "why": f"import failed: {err}"}
    from reprorl.models.tokenizer import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    config = Qwen2Config(hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                         num_hidden_layers=shape["num_hidden_layers"], num_attention_heads=shape["num_attention_heads"],
                         num_key_value_heads=shape["num_key_value_heads"], vocab_size=shape["vocab_size"],
                         max_position_embeddings=shape["max_position_embeddings"],
                         tie_word_embeddings=shape.get("tie_word_embeddings", True))
    if args.device == "cuda":  # TRL's own peak, not the reprorl modes' before it
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    g = torch.Generator().manual_seed(SEED)
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    prompts = ["".join(chars[int(i)] for i in torch.randint(0, 26, (args.prompt_len,), generator=g))
               for _ in range(args.prompts * 4)]
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync(args.device)
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync(args.device)
            times.append(time.perf_counter() - self.t0)

    # --micro-batch completions a forward/backward (as reprorl), the rest accumulated: one generation of prompts x n per
    # optimizer step (TRL's steps_per_generation defaults to the accumulation steps).
    micro = min(args.micro_batch, args.prompts * args.n)
    wanted = dict(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro,
        gradient_accumulation_steps=args.prompts * args.n // micro, num_generations=args.n,
        max_completion_length=args.new_tokens, max_prompt_length=args.prompt_len, max_steps=2, beta=0.0,
        bf16=args.device == "cuda", logging_steps=1, report_to=[], save_strategy="no", temperature=1.0,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    peft_config = None
    if args.lora_rank:
        import peft

        peft_config = peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules="all-linear")
    known = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    grpo = trl.GRPOConfig(**{k: v for k, v in wanted.items() if k in known})
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                              args=grpo, train_dataset=Dataset.from_dict({"prompt": prompts}),
                              processing_class=tokenizer, callbacks=[StepTimer()], peft_config=peft_config)
    trainer.train()
    return {"ran": True, "version": trl.__version__, "config": {k: v for k, v in wanted.items() if k in known},
            "step_s": times, "timed_step_s": times[-1] if times else None,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None}


def write(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shape = dict(QUICK if args.quick else SHAPES[args.shape])
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    result: dict = {"args": vars(args), "shape": shape, "matmul_params": matmul_params(shape),
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "modes": {}}
    print(f"GRPO step: {args.prompts} prompts x n={args.n}, {args.prompt_len} + {args.new_tokens} tokens, "
          f"{matmul_params(shape) / 1e6:.0f}M matmul parameters, on {args.device}", flush=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = make_model_dir(Path(scratch), shape, "bfloat16", args.device)
        print(f"random model written in {time.perf_counter() - t_start:.0f} s", flush=True)
        result["memory_estimate"] = estimate = memory_estimate(args, model_dir)
        print(f"memory estimate (reprorl config --memory, no CUDA contexts): {estimate['peak_gib']:.1f} GiB "
              f"during {estimate['peak_phase']}", flush=True)
        for mode in args.modes.split(","):
            result["modes"][mode] = run_mode(args, model_dir, shape, full_determinism=mode == "on")
            write(args.out, result)
    modes = result["modes"]
    if "on" in modes and "off" in modes:
        on, off = modes["on"]["timed"]["step_s"], modes["off"]["timed"]["step_s"]
        result["determinism_cost"] = on / off - 1.0
    if args.skip_trl:
        result["trl"] = {"ran": False, "why": "--skip-trl"}
    else:
        try:
            result["trl"] = run_trl(args, shape)
        except Exception as err:  # a bench: report TRL's failure, keep reprorl's figures
            result["trl"] = {"ran": False, "why": f"{type(err).__name__}: {err}"}
    trl_step = result["trl"].get("timed_step_s")
    if trl_step and "on" in modes:
        result["trl_over_reprorl_on"] = trl_step / modes["on"]["timed"]["step_s"]
    result["wall_s"] = time.perf_counter() - t_start
    for mode, rec in modes.items():
        s = rec["timed"]
        times = ", ".join(f"{rec[f'step{i}']['step_s']:.2f}" for i in range(2, 2 + args.timed_steps))
        print(f"determinism {mode}: steps {times} s; median step {s['step_s']:.2f} s (generation {s['generation_s']:.2f}, log-probs "
              f"{s['log_probs_s']:.2f}, update {s['update_s']:.2f}, sync+wake {s['weight_sync_and_wake_s']:.2f}), "
              f"update MFU {rec['update_mfu']:.1%}, peak {s['peak_gpu_gib']} GiB, old log-probs: {rec['old_log_probs']}, "
              f"log-prob gap {rec['log_prob_max_gap']} (warm-up step)")
    for mode, rec in modes.items():
        peak = rec["timed"]["peak_gpu_gib"]
        if peak:
            print(f"determinism {mode}: the memory estimate {result['memory_estimate']['peak_gib']:.1f} GiB is "
                  f"{result['memory_estimate']['peak_gib'] / peak - 1:+.1%} of the measured peak {peak:.1f} GiB")
    if "determinism_cost" in result:
        print(f"determinism costs {result['determinism_cost']:+.1%} of a step")
    print(f"TRL: {result['trl']}")
    write(args.out, result)
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
