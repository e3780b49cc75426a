"""LoRA adapters (Hu et al. 2021) on the model's linear layers, as PEFT lays them out.

A targeted `Linear` (transformer.py) gets `lora_A` [r, in] and `lora_B` [out, r] and
computes `linear(x, W, b) + linear(linear(x, A), B) * (alpha / r)`: PEFT's formula, in
PEFT's order, with the model's own kernels. The engine and the trainer run that one
`Linear.forward`, so a rollout's log-probs keep the trainer's bits with adapters as
without (`rollout/log_prob_max_gap` 0.0 is checked every step).

- Only the adapters train: the base weights stay frozen in the compute dtype, with no
  float32 master, gradient or AdamW state (the worker group's flat layout holds the
  trainable parameters only, so its shards, checkpoints and weight pushes are the adapters).
- The reference policy is the same model with the adapters switched off
  (`adapters_disabled`): no second copy of the base.
- `lora_A` is drawn as PEFT's default (kaiming-uniform with a = sqrt(5): uniform in
  +-1/sqrt(in)) from a generator seeded by the run seed and the parameter's name, on the
  host in float32, then cast: the same bits in the trainer and in every replica, on any
  device, with no weight push before the first rollout. `lora_B` starts at zero, so the
  adapted model starts as the base.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from reprorl.determinism import stable_hash

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections a target list may name (the linear layers of every decoder layer);
`all-linear` takes them all. The LM head is never adapted (PEFT's `all-linear` leaves it too)."""


@dataclass(frozen=True)
class LoraSpec:
    """What `add_adapters` builds: rank, alpha, the targeted projections, the init seed."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    seed: int

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_json(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules), "seed": self.seed}

    @classmethod
    def from_json(cls, d: dict) -> LoraSpec:
        return cls(int(d["rank"]), float(d["alpha"]), tuple(d["target_modules"]), int(d["seed"]))


def resolve_targets(target_modules: str | Sequence[str], key: str = "model.target_modules") -> tuple[str, ...]:
    """`all-linear` or a list of projection names -> the projections, in `TARGETS` order.
    An unknown name is a one-line error naming `key` and the names it may take."""
    if isinstance(target_modules, str):
        if target_modules != "all-linear":
            raise ValueError(f"{key}: {target_modules!r}; expected 'all-linear' or a list of {', '.join(TARGETS)}")
        return TARGETS
    names = list(target_modules)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ValueError(f"{key}: unknown module {unknown[0]!r}; expected 'all-linear' or names from {', '.join(TARGETS)}")
    if not names:
        raise ValueError(f"{key}: an empty list adapts nothing; expected 'all-linear' or names from {', '.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in names)


def spec_from_config(model_cfg, seed: int) -> LoraSpec | None:
    """The run's `LoraSpec` from its `model` section (None: `model.lora_rank` is 0, LoRA off)."""
    if model_cfg.lora_rank == 0:
        return None
    return LoraSpec(model_cfg.lora_rank, float(model_cfg.lora_alpha), resolve_targets(model_cfg.target_modules), seed)


def adapted_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(module name, Linear) of every linear layer that carries adapters, in module order."""
    for name, module in model.named_modules():
        if getattr(module, "lora_A", None) is not None:
            yield name, module


def add_adapters(model: nn.Module, spec: LoraSpec) -> None:
    """Give every targeted linear layer of `model`'s decoder layers its adapters (see the
    module docstring for their init) and freeze everything else; the adapters take the
    dtype and device of the weight they adapt."""
    from reprorl.models.transformer import Linear

    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, Linear) and name.rsplit(".", 1)[-1] in spec.target_modules]
    if not targets:
        raise ValueError(f"model.target_modules {list(spec.target_modules)} match no linear layer of the model")
    model.requires_grad_(False)
    for name, linear in targets:
        out_features, in_features = linear.weight.shape
        generator = torch.Generator().manual_seed(stable_hash("lora_A", spec.seed, name) >> 1)
        bound = 1.0 / math.sqrt(in_features)
        a = (torch.rand(spec.rank, in_features, generator=generator, dtype=torch.float32) * 2 - 1) * bound
        like = {"dtype": linear.weight.dtype, "device": linear.weight.device}
        linear.lora_A = nn.Parameter(a.to(**like))
        linear.lora_B = nn.Parameter(torch.zeros(out_features, spec.rank, **like))
        linear.lora_scaling = spec.scaling


def has_adapters(model: nn.Module) -> bool:
    return next(adapted_linears(model), None) is not None


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model inside the block (the reference policy): every adapter switched off."""
    linears = [m for _, m in adapted_linears(model)]
    for m in linears:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in linears:
            m.lora_enabled = True


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with each adapted weight merged, `W + (B @ A) * scaling` (as PEFT's
    `merge_and_unload`: the product in float32, then cast to W's dtype), and no adapter
    tensors: what a plain HF model of the same config loads."""
    state = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    for name, linear in adapted_linears(model):
        state[f"{name}.weight"] = merged_weight(linear)
    return state


def merged_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter but the adapters, in `named_parameters` order, each
    adapted weight merged as `merged_state` merges it: what a server of the plain model (vLLM)
    takes as the LoRA policy's weights."""
    merged = {f"{name}.weight": merged_weight(linear) for name, linear in adapted_linears(model)}
    return [(n, merged.get(n, p.detach())) for n, p in model.named_parameters() if ".lora_" not in n]


def merged_weight(linear: nn.Module) -> torch.Tensor:
    """`W + (B @ A) * scaling`, the product in float32, then cast to W's dtype."""
    with torch.no_grad():
        delta = (linear.lora_B.float() @ linear.lora_A.float()) * linear.lora_scaling
        return (linear.weight.float() + delta).to(linear.weight.dtype)


def peft_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under the names PEFT saves them (`adapter_model.safetensors`)."""
    out = {}
    for name, linear in adapted_linears(model):
        out[f"base_model.model.{name}.lora_A.weight"] = linear.lora_A.detach().contiguous()
        out[f"base_model.model.{name}.lora_B.weight"] = linear.lora_B.detach().contiguous()
    return out


def peft_config(spec: LoraSpec, base_model_path: str) -> dict:
    """`adapter_config.json` for PEFT's `PeftModel.from_pretrained` (no dropout: none trained)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_path,
        "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.target_modules),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }
