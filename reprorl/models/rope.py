"""Rotary position embeddings and their scaled variants, read from config.json and computed
as transformers computes them (`modeling_rope_utils`; its tests check the bits here).

A variant is an inverse-frequency vector and an attention factor that multiplies cos and
sin; both are fixed per model, so the rotary tables (`kernels.shared.rotary_tables`) stay
constants of the position and every kernel backend reads them unchanged:
- "default": inv_freq_i = 1 / theta^(2i / D);
- "linear": the default's divided by `factor` (position interpolation);
- "llama3": Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth
  blend between (`low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`);
- "yarn": YaRN's blend of interpolated and extrapolated frequencies over a ramp set by
  `beta_fast`/`beta_slow`, and its attention factor 0.1 ln(factor) + 1 (or `mscale`s);
- "longrope" (Phi-3.5, Phi-4-mini): the base frequencies divided by `short_factor`, with
  sqrt(1 + ln(factor) / ln(original max)) as the attention factor. transformers switches
  every position to `long_factor` once the batch's longest sequence passes
  `original_max_position_embeddings`, so a token's rotation would depend on its batch:
  positions stop there (`max_positions`), inside which the short factors are exact.
"dynamic" (NTK) rescales every position by the longest sequence of the forward pass, the
same dependence on the batch without a length inside which it is constant: refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from reprorl.errors import ConfigError
from reprorl.kernels.pinned import pinned_pow

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class RopeScaling:
    """A config.json's RoPE: its type and the type's keys (hashable: lists become tuples)."""

    rope_type: str = "default"
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], model_type: str) -> RopeScaling:
        """From transformers 5's `rope_parameters` or 4.x's `rope_scaling`; a one-line error
        naming the key for a type or a setting this module cannot compute."""
        for source in ("rope_parameters", "rope_scaling"):
            spec = config.get(source) or {}
            rope_type = spec.get("rope_type", spec.get("type", "default"))
            if rope_type != "default":
                break
        else:
            return cls()
        where = f"config.json {source} (model_type {model_type})"
        if rope_type not in ROPE_TYPES:
            why = ("it rescales every position by the batch's longest sequence, which no batch-invariant kernel "
                   "can reproduce; " if rope_type == "dynamic" else "")
            raise ConfigError(f"{where}: rope type {rope_type!r} is not supported ({why}expected one of "
                              f"{', '.join(ROPE_TYPES)})")
        spec = dict(spec)
        if spec.get("original_max_position_embeddings") is None and config.get("original_max_position_embeddings"):
            spec["original_max_position_embeddings"] = config["original_max_position_embeddings"]  # Phi-3, 4.x
        missing = [key for key in REQUIRED[rope_type] if spec.get(key) is None]
        if missing:
            raise ConfigError(f"{where}: rope type {rope_type!r} needs {', '.join(missing)}")
        keep = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()
                if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")}  # the last: ModelArgs
        return cls(rope_type, tuple(sorted(keep.items())))

    def to_hf(self, rope_theta: float) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(rope_scaling for transformers 4.x, rope_parameters for 5.x) of config.json."""
        params = {k: list(v) if isinstance(v, tuple) else v for k, v in self.params}
        parameters = {"rope_type": self.rope_type, "rope_theta": rope_theta, **params}
        return (None if self.rope_type == "default" else {"rope_type": self.rope_type, **params}), parameters


def inverse_frequencies(scaling: RopeScaling, head_dim: int, theta: float,
                        max_position_embeddings: int) -> tuple[Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention factor) of `scaling`, as transformers."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    base = 1.0 / pinned_pow(theta, exponents)
    kind, get = scaling.rope_type, scaling.get
    if kind == "default":
        return base, 1.0
    if kind == "linear":
        return base / get("factor"), 1.0
    if kind == "llama3":
        return _llama3(base, get("factor"), get("low_freq_factor"), get("high_freq_factor"),
                       get("original_max_position_embeddings")), 1.0
    original = get("original_max_position_embeddings") or max_position_embeddings
    if kind == "yarn":
        return _yarn(scaling, head_dim, theta, original)
    factor = get("factor") or max_position_embeddings / original  # longrope
    attention = get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = torch.tensor(get("short_factor"), dtype=torch.float32)
    return 1.0 / (short * pinned_pow(theta, exponents)), float(attention)


def max_positions(scaling: RopeScaling, max_position_embeddings: int) -> int:
    """How many positions the tables hold: longrope's stop at its original length (module doc)."""
    if scaling.rope_type == "longrope":
        return min(max_position_embeddings, scaling.get("original_max_position_embeddings"))
    return max_position_embeddings


def _llama3(inv_freq: Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
            old_context_len: int) -> Tensor:
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(scaling: RopeScaling, dim: int, base: float, original: int) -> tuple[Tensor, float]:
    get = scaling.get
    factor = get("factor")
    attention = get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = get("mscale"), get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention = _yarn_mscale(factor)
    beta_fast, beta_slow = get("beta_fast") or 32, get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = pinned_pow(base, torch.arange(0, dim, 2).to(torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of each frequency extrapolated (kept as trained)
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
