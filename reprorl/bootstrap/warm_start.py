"""Supervised warm start: a short fine-tune on (chat messages, answer) pairs before RL.

A freshly initialised tiny model never writes a correct answer, so RL on it has no
reward to learn from. A few hundred supervised steps teach it the answer format and part
of the task; RL then has to do the rest (the default run measures its gain from there).

    out = warm_start("models/tiny-policy", "models/tiny-policy-warm", pairs,
                     steps=300, batch_size=64, lr=1e-3, seed=42)

Each pair is (prompt messages, answer text). The model sees the prompt through the
tokenizer's chat template with the generation prompt, then the answer's tokens and eos;
the loss is the token-mean cross-entropy on the answer and eos only, so it learns to
answer and to stop, never to imitate the prompt.

The run is a pure function of (weights in `model_dir`, pairs, arguments): batches come
from a `torch.Generator(seed)` and the global RNGs are not used. With `batch_invariant`
on the CPU (the default run's policy) the model runs on the batch-invariant CPU kernels,
forward and backward, so with torch's CPU kernels pinned to their portable build
(`ATEN_CPU_CAPABILITY=default`, as full determinism sets) the output files are the same
bytes on any x86-64 CPU at any thread count. Otherwise (stock kernels: a BLAS) only on a
rerun on the same machine and thread count (on a GPU, `device="cuda"`, only with torch's
deterministic algorithms on: embedding backward adds with atomics otherwise).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from reprorl.errors import ConfigError
from reprorl.kernels import select_kernels
from reprorl.kernels.pinned import pinned_log_softmax
from reprorl.models.hf_io import load_model, save_model
from reprorl.workers.optim import OptimArgs, guarded_step, lr_multiplier, make_adamw, set_lr

logger = logging.getLogger(__name__)

Pair = tuple[list[dict], str]  # (chat messages of the prompt, answer text)
# Files of a model directory that hold weights: replaced by the trained ones, not copied.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def sft_example(tokenizer: PreTrainedTokenizerBase, messages: list[dict], answer: str) -> tuple[list[int], list[int]]:
    """One training sequence: (input_ids, loss_mask), both of length T.

    input_ids = chat template of `messages` with the generation prompt, then the answer's
    tokens, then eos; loss_mask is 1 exactly on the answer's tokens and the eos.
    """
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    target = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt + target, [0] * len(prompt) + [1] * len(target)


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_token_id: int) -> tuple[torch.Tensor, ...]:
    """Right-pad examples into (input_ids, attention_mask, loss_mask), each `[B, T]` long."""
    length = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, (ids, mask) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        loss_mask[row, : len(ids)] = torch.tensor(mask)
    return input_ids, attention_mask, loss_mask


def sft_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy of the masked tokens, each predicted from the ones before.

    logits `[B, T, V]` (position t predicts token t + 1), input_ids `[B, T]`, loss_mask
    `[B, T]` (1 on tokens to learn; position 0 is never a target). Returns a scalar.
    """
    log_probs = pinned_log_softmax(logits[:, :-1].float())  # [B, T-1, V]
    token_log_probs = log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    mask = loss_mask[:, 1:].to(token_log_probs.dtype)
    return -(token_log_probs * mask).sum() / mask.sum().clamp(min=1)


def batch_indices(num_examples: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """The example indices of each step's batch: seeded permutations laid end to end.

    A batch that crosses an epoch boundary takes the end of one permutation and the start
    of the next, so every example is seen once per epoch and no batch is short.
    """
    generator = torch.Generator().manual_seed(seed)
    stream: list[int] = []
    batches = []
    for _ in range(steps):
        while len(stream) < batch_size:
            stream += torch.randperm(num_examples, generator=generator).tolist()
        batches.append(stream[:batch_size])
        stream = stream[batch_size:]
    return batches


def sft_train(
    model: torch.nn.Module,
    examples: Sequence[tuple[list[int], list[int]]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    pad_token_id: int,
    lr_schedule: str = "cosine",
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    log_every: int = 50,
    device: str = "cpu",
    batch_invariant: bool = False,
    stop_after: int | None = None,
) -> list[float]:
    """Train `model` in place on tokenised examples (`sft_example`); returns each step's loss.
    `stop_after`: stop after that many of the `steps` (whose schedule it keeps), for probes.

    `device` "cuda": the model (float32 weights and AdamW state) is moved there and its
    forward runs under bf16 autocast (mixed precision); the loss is taken in float32.
    `batch_invariant`: the model runs on the device's batch-invariant kernels
    (`reprorl.kernels.select_kernels`), else on its stock ones.

    AdamW with the trainer's optimizer helpers; `lr_schedule` "cosine" decays the rate to 0
    over `steps`, "constant" keeps it. Cosine is the default for a reason: stopping at a
    high constant rate leaves the weights mid-oscillation, and then ANY further training at
    a small rate (RL included) gains a lot at once, which would be credited to RL.
    """
    optim_args = OptimArgs(lr=lr, weight_decay=weight_decay, lr_schedule=lr_schedule, total_steps=steps, grad_clip=grad_clip)
    model.to(device)
    if batch_invariant:
        model.kernels = select_kernels(device, batch_invariant=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_adamw(params, optim_args)
    model.train()
    losses = []
    for step, indices in enumerate(batch_indices(len(examples), batch_size, steps, seed)[:stop_after]):
        step_lr = lr * lr_multiplier(step, warmup_steps=0, total_steps=steps, schedule=lr_schedule)
        set_lr(optimizer, step_lr)
        input_ids, attention_mask, loss_mask = (t.to(device) for t in collate([examples[i] for i in indices],
                                                                               pad_token_id))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids, attention_mask)
        loss = sft_loss(logits, input_ids, loss_mask)
        loss.backward()
        guarded_step(optimizer, params, grad_clip, where=f"warm start step {step + 1}")
        losses.append(float(loss.detach()))
        if log_every and ((step + 1) % log_every == 0 or step + 1 == steps):
            recent = losses[-log_every:]
            logger.info(
                "warm start step %d/%d: loss %.4f (mean of last %d), lr %.2e",
                step + 1, steps, sum(recent) / len(recent), len(recent), step_lr,
            )
    return losses


def warm_start(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    pairs: Sequence[Pair],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    lr_schedule: str = "cosine",
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    log_every: int = 50,
    device: str = "cpu",
    batch_invariant: bool = False,
) -> Path:
    """Fine-tune the causal LM in `model_dir` on `pairs` and write it to `out_dir`.

    `out_dir` gets an HF directory: config.json and model.safetensors written by
    `reprorl.models.hf_io.save_model`, and the other files of `model_dir` (tokenizer,
    chat template) copied unchanged; all first into a temporary sibling
    directory, then renamed into place, so `out_dir` is either absent, the old directory,
    or the complete new one. An existing `out_dir` is replaced. Returns `out_dir`.
    """
    if not pairs:
        raise ConfigError("warm start: pairs is empty; expected at least one (messages, answer) pair")
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"warm start: {name}={value!r}; expected an integer >= 1")
    if not lr > 0:
        raise ConfigError(f"warm start: lr={lr!r}; expected a number > 0")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    model, args = load_model(model_dir, kind="causal_lm")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = [sft_example(tokenizer, messages, answer) for messages, answer in pairs]
    logger.info("warm start: %s -> %s, %d pairs, %d steps of %d", model_dir, out_dir, len(pairs), steps, batch_size)
    sft_train(
        model, examples, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
        pad_token_id=tokenizer.pad_token_id, lr_schedule=lr_schedule, weight_decay=weight_decay,
        grad_clip=grad_clip, log_every=log_every, device=device, batch_invariant=batch_invariant,
    )
    model.to("cpu")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_model(model, args, tmp)
        # Everything else (tokenizer, chat template, generation config) is copied byte for
        # byte: a save_pretrained round trip would add keys to tokenizer_config.json.
        for path in sorted(model_dir.iterdir()):
            if path.is_file() and path.name != "config.json" and not path.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copyfile(path, tmp / path.name)
        # rename() cannot replace a non-empty directory: move the old one aside first,
        # and back if the new one cannot take its place.
        if out_dir.exists():
            os.rename(out_dir, old)
        try:
            os.rename(tmp, out_dir)
        except BaseException:
            if old.exists():
                os.rename(old, out_dir)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir
