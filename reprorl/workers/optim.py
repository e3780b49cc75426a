"""AdamW, the learning-rate schedule and the optimizer steps: the ranks' chunked step on
their master shard (worker.py), and the guarded step of the SFT warm start
(bootstrap/warm_start.py).

The schedule is stepped once per TRAINING step (one `update` call of a rank), not once
per optimizer step: `warmup_steps` and `total_steps` then count the same steps as
`trainer.total_steps`, and the learning rate of a step does not depend on how many
mini-batches the step was cut into (verl steps its scheduler the same way). Every
mini-batch of one training step uses the same learning rate.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal, localcontext

import torch

from reprorl.errors import ReproRLError
from reprorl.kernels.optim_math import AdamWScalars, adamw_step_

LR_SCHEDULES = ("constant", "cosine")


class NonFiniteError(ReproRLError, RuntimeError):
    """A loss, gradient norm or other quantity of a step was NaN or infinite; the optimizer
    was not stepped.

    A user-facing error (one line from the CLI): it comes from the run's settings or
    data (a learning rate that diverges, a reward that blows up), not from a bug.
    """


@dataclass(frozen=True)
class OptimArgs:
    """What a trainable worker's optimizer and schedule need (plain values, not the config)."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    total_steps: int = 1
    """Training steps of the run: the cosine schedule reaches its end here."""
    grad_clip: float = 1.0
    """Clip the gradients' global L2 norm to this before each optimizer step."""

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}; got {self.lr_schedule!r}")
        if self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0; got {self.grad_clip}")


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """The factor on the base learning rate for training step `step` (0-based).

    Warm-up: `(step + 1) / warmup_steps` for the first `warmup_steps` steps (linear, and
    the first step already learns: verl's 0 at step 0 wastes a step). Then "constant": 1;
    "cosine": `0.5 * (1 + cos(pi * p))` with `p = (step - warmup_steps) / (total_steps -
    warmup_steps)` clamped to [0, 1], so 1 right after warm-up and 0 at `total_steps`.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule must be one of {', '.join(LR_SCHEDULES)}; got {schedule!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    return 0.5 * (1.0 + exact_cos(math.pi * progress))


# The optimizer's and the schedule's scalars by decimal arithmetic, correctly rounded: the
# C library's pow and cos (what Python's ** and math.cos call, and torch's AdamW takes its
# bias corrections from) are not correctly rounded everywhere, and their bits may differ
# between C library versions, which would part two machines' runs.
_DIGITS = 40


def exact_power(base: float, exponent: int) -> float:
    """base ** exponent for an integer exponent >= 0, correctly rounded (but for a result
    within 1e-40 of a rounding boundary)."""
    with localcontext() as ctx:
        ctx.prec = _DIGITS
        return float(Decimal(base) ** int(exponent))


def exact_cos(x: float) -> float:
    """cos x for |x| <= 4, correctly rounded (but within 1e-35 of a rounding boundary):
    its Taylor series in decimal arithmetic."""
    if abs(x) > 4:
        raise ValueError(f"exact_cos: |x| <= 4 expected, got {x}")
    with localcontext() as ctx:
        ctx.prec = _DIGITS + 5
        x2 = Decimal(x) ** 2
        total = term = Decimal(1)
        n = 0
        while abs(term) > Decimal(10) ** -(_DIGITS + 2):
            n += 2
            term = -term * x2 / (n * (n - 1))
            total += term
        return float(total)


class AdamW:
    """AdamW's hyper-parameters and per-parameter state, kept as `torch.optim.AdamW` keeps
    them (`param_groups[0]`: lr, betas, eps, weight_decay; `state[param]`: step, exp_avg,
    exp_avg_sq), and stepped by `step_in_chunks` (torch's AdamW's arithmetic, each operation
    rounded once). Not torch's optimizer itself: nothing here calls its `step`, and its constructor
    imports torch._dynamo (about 1.1 s of a core in every training rank)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, betas: tuple[float, float],
                 weight_decay: float, eps: float = 1e-8):
        self.params = list(params)
        self.param_groups = [{"params": self.params, "lr": lr, "betas": betas, "eps": eps,
                              "weight_decay": weight_decay}]
        self.state: defaultdict[torch.nn.Parameter, dict[str, torch.Tensor]] = defaultdict(dict)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None


def make_adamw(params: Iterable[torch.nn.Parameter], args: OptimArgs) -> AdamW:
    """AdamW on `params`, weight decay on every parameter (as verl), eps torch's 1e-8."""
    return AdamW(params, lr=args.lr, betas=args.betas, weight_decay=args.weight_decay)


STEP_CHUNK = 1 << 24
"""Elements of a parameter stepped at once by `step_in_chunks` (its temporaries on a GPU: 64 MiB each)."""


def step_in_chunks(optimizer: AdamW, param: torch.nn.Parameter, chunk: int = STEP_CHUNK,
                   grad_scale: float = 1.0) -> None:
    """One AdamW step of `param` (one of `optimizer`'s parameters, its `.grad` set, times
    `grad_scale`: the clipping's factor), a `chunk` of elements at a time, by
    `kernels.optim_math.adamw_step_`: one IEEE operation a step, the same bits on the host and
    on a GPU (so an offloaded optimizer steps as one on the GPU), and the same bits whatever
    the chunk, as each element's update is its own.

    Decoupled weight decay, then m = beta1 m + (1 - beta1) g, v = beta2 v + (1 - beta2) g^2,
    p -= step_size m / (sqrt(v) / sqrt(1 - beta2^t) + eps), step_size = lr / (1 - beta1^t):
    torch's AdamW, with each of its fused operations (lerp, addcmul, addcdiv) written out as
    separately rounded ones (optim_math.py says why). The bias corrections come from
    `exact_power` and `math.sqrt` (both correctly rounded, so the same on every machine;
    torch's from the C library's pow). The state is what torch's AdamW keeps (`step`,
    `exp_avg`, `exp_avg_sq`), so checkpoints do not change."""
    group, state = optimizer.param_groups[0], optimizer.state[param]
    if not state:  # as AdamW's first step makes it (not capturable, not fused)
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["step"] += 1
    step = int(state["step"].item())
    beta1, beta2 = group["betas"]
    scalars = AdamWScalars.of(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                              weight_decay=group["weight_decay"], grad_scale=grad_scale,
                              bias1=1 - exact_power(beta1, step), bias2=math.sqrt(1 - exact_power(beta2, step)))
    flat, grad = param.detach().view(-1), param.grad.view(-1)
    exp_avg, exp_avg_sq = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    for start in range(0, flat.numel(), chunk):
        piece = slice(start, min(start + chunk, flat.numel()))
        adamw_step_(flat[piece], grad[piece], exp_avg[piece], exp_avg_sq[piece], scalars)


def set_lr(optimizer: AdamW, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


NORM_ROW = 4096
"""Elements a row of a gradient's sum of squares (each row summed by one thread)."""


def sum_of_squares(g: torch.Tensor) -> torch.Tensor:
    """The sum of g's squares, float64 [], in an order fixed by g's size alone.

    Rows of NORM_ROW elements (float32; the last padded with zeros), each summed by one
    thread, then the rows' sums one after another (a running sum: `cumsum`). torch's
    own full reduction of a large tensor splits it over its threads, so its bits would
    follow the thread count.
    """
    flat = g.detach().float().reshape(-1)
    rows = torch.nn.functional.pad(flat, (0, -flat.numel() % NORM_ROW)).view(-1, NORM_ROW)
    sums = rows.square().sum(dim=-1).double()  # [rows]
    return sums.cumsum(0)[-1] if len(sums) else sums.new_zeros(())


def clip_grads(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Scale the gradients so their global L2 norm is at most `max_norm`; return the norm
    BEFORE clipping (NaN/inf when a gradient is not finite; the gradients are then left
    as they are). Parameters without a gradient count as zero."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm_value = math.sqrt(float(torch.stack([sum_of_squares(g) for g in grads]).cumsum(0)[-1]))
    if math.isfinite(norm_value) and norm_value > max_norm:
        scale = max_norm / (norm_value + 1e-6)  # as torch's clip_grad_norm_
        for g in grads:
            g.mul_(scale)
    return norm_value


def guarded_step(
    optimizer: AdamW, params: list[torch.nn.Parameter], grad_clip: float, where: str
) -> float:
    """Clip, then step the optimizer, then clear the gradients; return the pre-clip norm.

    A non-finite norm raises `NonFiniteError` naming `where` (which update, mini-batch)
    WITHOUT stepping: parameters and optimizer state stay as they were; the gradients are
    cleared so the next update starts clean.
    """
    grad_norm = clip_grads(params, grad_clip)
    if not math.isfinite(grad_norm):
        optimizer.zero_grad()
        raise NonFiniteError(f"{where}: gradient norm is {grad_norm}; optimizer not stepped")
    for param in params:
        if param.grad is not None:
            step_in_chunks(optimizer, param)
    optimizer.zero_grad()
    return grad_norm


@dataclass
class LRSchedule:
    """The base learning rate and the count of training steps taken (checkpointed)."""

    base_lr: float
    warmup_steps: int
    total_steps: int
    schedule: str
    step: int = 0

    def lr(self) -> float:
        """The learning rate of the current training step."""
        return self.base_lr * lr_multiplier(
            self.step, warmup_steps=self.warmup_steps, total_steps=self.total_steps, schedule=self.schedule
        )

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
