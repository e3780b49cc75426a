"""A rollout call's rows as typed requests: who each sample is and how it is drawn.

The trainer hands the agent loop a `Batch` (the prompts and the data columns the rewards
read later) and, for ReMax, which rows are greedy; `rollout_requests` turns each row into
a `RolloutRequest` and checks it, so that nothing downstream reads a row's identity from a
column by name. Its fields are everything that fixes a sample's bits: with the run seed and
the sampling params they give its request id and seeds (`manager.plan_samples`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from reprorl.errors import DataError
from reprorl.protocol import Batch

IDENTITY_COLUMNS = ("uid", "repeat_index", "prompt_ids", "raw_prompt")
"""The non-tensor columns a request is made of; the row's other columns go to `extra`."""


@dataclass(frozen=True)
class RolloutRequest:
    """One row of a rollout call."""

    uid: str | int
    """The prompt's id: the n samples of one prompt share it."""
    repeat_index: int
    """Which of the prompt's samples this is (ReMax's greedy row: n, apart from the samples)."""
    step: int
    phase: Literal["train", "val"]
    """"val" for a validation's rows: their seeds stay apart from training's."""
    prompt_ids: list[int] | None = None
    """The dataset's token ids (cut to `data.max_prompt_length` where it truncates); they win
    over `raw_prompt` when a row has both."""
    raw_prompt: list[dict[str, str]] | None = None
    """The chat messages, templated by the agent-loop worker when there are no ids."""
    do_sample: bool = True
    """False: greedy (temperature 0), as ReMax's baseline rows."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """The row's other non-tensor columns (e.g. `agent_name`, tool kwargs), for the loop."""

    @property
    def request_id(self) -> str:
        """The same for every turn of the sample, and for every run of the same config."""
        return f"{self.phase}/{self.step}/{self.uid}/{self.repeat_index}"


def rollout_requests(batch: Batch, do_sample: Sequence[bool] | None = None) -> list[RolloutRequest]:
    """`batch`'s rows as requests, in row order.

    Reads the non-tensor columns `uid`, `repeat_index` and `prompt_ids` or `raw_prompt`,
    and meta `step` (int) and `validate` (bool, default False). `do_sample`: one flag a row
    (None: every row sampled). A row or meta entry of the wrong type is a DataError naming it.
    """
    n = len(batch)
    step, validate = batch.meta.get("step"), batch.meta.get("validate", False)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise DataError(f"rollout batch meta 'step'={step!r}: expected an int")
    if not isinstance(validate, (bool, np.bool_)):
        raise DataError(f"rollout batch meta 'validate'={validate!r}: expected true or false")
    for key in ("uid", "repeat_index"):
        if key not in batch.non_tensors:
            raise DataError(f"rollout batch has no non-tensor column {key!r}; columns: {batch.keys()}")
    prompt_key = "prompt_ids" if "prompt_ids" in batch.non_tensors else "raw_prompt"
    if prompt_key not in batch.non_tensors:
        raise DataError(
            f"rollout batch needs a non-tensor column 'raw_prompt' or 'prompt_ids'; columns: {batch.keys()}"
        )
    flags = [True] * n if do_sample is None else list(do_sample)
    if len(flags) != n:
        raise ValueError(f"do_sample has {len(flags)} flags for a rollout batch of {n} rows; expected one a row")
    extra_keys = [k for k in batch.non_tensors if k not in IDENTITY_COLUMNS]
    return [_request(batch, i, int(step), "val" if validate else "train", prompt_key, flags[i], extra_keys)
            for i in range(n)]


def _request(batch: Batch, i: int, step: int, phase: Literal["train", "val"], prompt_key: str, flag: Any,
             extra_keys: list[str]) -> RolloutRequest:
    columns = batch.non_tensors
    repeat = columns["repeat_index"][i]
    if isinstance(repeat, bool) or not isinstance(repeat, (int, np.integer)):
        raise DataError(f"rollout batch row {i}: repeat_index={repeat!r}, expected an int")
    if not isinstance(flag, (bool, np.bool_)):
        raise DataError(f"rollout batch row {i}: do_sample={flag!r}, expected true or false")
    prompt = columns[prompt_key][i]
    return RolloutRequest(
        uid=columns["uid"][i], repeat_index=int(repeat), step=step, phase=phase,
        prompt_ids=[int(t) for t in prompt] if prompt_key == "prompt_ids" else None,
        raw_prompt=list(prompt) if prompt_key == "raw_prompt" else None,
        do_sample=bool(flag), extra={k: columns[k][i] for k in extra_keys},
    )
