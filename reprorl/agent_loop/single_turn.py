"""One sample as an agent loop sees it, and the single-turn loop (prompt -> one response).

A loop is a class with `async run(sample, generate) -> AgentOutput`. It never routes,
seeds or pads by itself: the manager gives it the sample's identity (request id, seed
of each turn, priority), and `generate` is the only way it reaches a model:

    await generate(request_id, prompt_ids, sampling_params, seed, priority) -> GenerateOutput

(in a worker, the load-balanced call to a rollout replica; in tests, a scripted fake).
Everything a loop returns is a function of its sample and what `generate` returned.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from reprorl.determinism import request_seed
from reprorl.rollout.request import SamplingParams

GenerateFn = Callable[[str, list[int], SamplingParams, int, int], Awaitable[Any]]


@dataclass(frozen=True)
class AgentSample:
    """One row of a rollout batch, as the loop sees it (`plan_samples` makes it from the row's request).

    `sampling_params.max_tokens` is the whole response budget (`rollout.max_tokens`, at
    most `max_response_length`); a multi-turn loop shares it among its turns.
    """

    index: int
    """Row number in the batch; the engine's priority (lower is admitted first)."""
    request_id: str
    """The same for every turn, so the balancer keeps a multi-turn sample on one replica."""
    prompt_ids: list[int] | None
    """The prompt's token ids (the worker fills them from `raw_prompt` before the loop runs)."""
    sampling_params: SamplingParams
    seed_identity: tuple[int, int, str | int, int, str]
    """(run_seed, step, uid, repeat_index, phase): `seed(turn)` derives each turn's seed."""
    raw_prompt: list[dict[str, str]] | None = None
    """The chat messages, when the row gave them instead of ids."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The row's other non-tensor columns (e.g. tool kwargs); read-only."""

    def seed(self, turn: int) -> int:
        run_seed, step, uid, repeat_index, phase = self.seed_identity
        return request_seed(run_seed, step, uid, repeat_index, turn, phase=phase)


@dataclass
class AgentOutput:
    """What a loop produced for one sample; lists of equal length for the response."""

    prompt_ids: list[int]
    response_ids: list[int]
    """Every token after the prompt: model turns and, for tool loops, tool turns."""
    response_mask: list[int]
    """1 on tokens the model generated, 0 on tool outputs and template tokens."""
    response_log_probs: list[float]
    """The engine's log-prob of each model token; 0.0 on tokens with mask 0."""
    num_turns: int
    """Number of generate calls (assistant turns)."""
    finish_reason: str
    """The last turn's ("stop" | "length" | "abort"); "length" when the budget ran out."""


class SingleTurnAgentLoop:
    """One generate call on the prompt; the response is the model's tokens, all masked 1."""

    async def run(self, sample: AgentSample, generate: GenerateFn) -> AgentOutput:
        out = await generate(
            sample.request_id, sample.prompt_ids, sample.sampling_params, sample.seed(0), sample.index
        )
        tokens = list(out.token_ids)
        return AgentOutput(
            prompt_ids=list(sample.prompt_ids),
            response_ids=tokens,
            response_mask=[1] * len(tokens),
            response_log_probs=output_log_probs(out, len(tokens)),
            num_turns=1,
            finish_reason=out.finish_reason,
        )


def output_log_probs(out: Any, n: int) -> list[float]:
    """A generate output's `n` log-probs as floats (zeros when the params asked for none)."""
    if out.log_probs is None:
        return [0.0] * n
    values = [float(x) for x in out.log_probs]
    if len(values) != n:
        raise RuntimeError(f"generate returned {n} tokens but {len(values)} log-probs")
    return values
