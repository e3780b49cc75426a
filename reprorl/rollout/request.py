"""A generate request's parameters (`SamplingParams`), its result (`GenerateOutput`) and the
check every backend makes of its prompt (`check_prompt`).

Their own module, without torch: the agent-loop workers build the first and receive the
second, and a process that only routes requests should not pay torch's import (about 2 s of
a core and 300 MB). How a token is drawn: `reprorl.rollout.sampling`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reprorl.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples; validated on construction (errors name the field)."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax, the seed is ignored)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens with mass >= top_p; 1 = off."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = off."""
    max_tokens: int = 16
    """Most tokens to generate (the finish reason is "length" when reached)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end generation (finish reason "stop"); the stop token is kept in the output."""
    ignore_eos: bool = False
    """Keep generating past the engine's eos token (benchmarks: equal lengths)."""
    logprobs: bool = True
    """Return the log-prob of each generated token."""

    def __post_init__(self) -> None:
        # A list from YAML/JSON becomes a tuple so the params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"SamplingParams.temperature={t!r}: expected a finite number >= 0 (0 = greedy)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ConfigError(f"SamplingParams.top_p={p!r}: expected a number in (0, 1]")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or (k != -1 and k < 1):
            raise ConfigError(f"SamplingParams.top_k={k!r}: expected -1 (off) or an integer >= 1")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"SamplingParams.max_tokens={m!r}: expected an integer >= 1")
        for s in self.stop_token_ids:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ConfigError(
                    f"SamplingParams.stop_token_ids={list(self.stop_token_ids)!r}: expected token ids >= 0"
                )
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"SamplingParams.{name}={getattr(self, name)!r}: expected true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerateOutput:
    """One finished request."""

    request_id: str
    token_ids: list[int]
    """Generated tokens (a stop/eos token that ended generation is included)."""
    log_probs: list[float] | None
    """Per generated token, `log_softmax(logits / T)` at it (`reprorl.rollout.sampling`); None if not asked."""
    finish_reason: str
    """"stop" (eos or a stop token), "length" (max_tokens or the context is full) or "abort"."""
    num_prompt_tokens: int
    weight_version: int
    """The weight version of the engine when the request's first forward pass ran."""


def check_prompt(request_id: str, prompt_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """Refuse a prompt no engine can serve: empty, no room for one new token, or an id
    outside the vocabulary (ValueError naming the request). Every backend's generate calls it."""
    n = len(prompt_ids)
    if n == 0:
        raise ValueError(f"generate({request_id!r}): empty prompt")
    if n >= max_model_len:
        raise ValueError(f"generate({request_id!r}): prompt of {n} tokens leaves no room in max_model_len={max_model_len}")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"generate({request_id!r}): prompt token ids must lie in [0, {vocab_size})")
