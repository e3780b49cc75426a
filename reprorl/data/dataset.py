"""Prompt datasets in verl's schema, tokenised, and the order they are served in.

A row of a prompt file (parquet or JSONL) has the fields verl's RLHF datasets use:

    data_source   str                      picks the rule reward (see `rewards.compute_score`)
    prompt        list of {"role", "content"} chat messages, at least one
    ability       str                      free-form tag, e.g. "math"
    reward_model  {"style": "rule" | "model", "ground_truth": str}
                  (ground_truth may be absent or null when style is "model")
    extra_info    dict, optional           e.g. {"split": "train", "index": 7}

Every row gets a stable `index`: its position in the files concatenated in the order
given. Filtering keeps it, so a prompt's uid can be built from it on any run.

`PromptSampler` serves positions in the dataset batch by batch; the order of epoch e is
a pure function of (seed, e) and the position is checkpointable.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from reprorl.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

EXTENSIONS = (".parquet", ".jsonl")
OVERLONG_MODES = ("error", "filter", "truncate_left", "truncate_right")
REWARD_STYLES = ("rule", "model")


# ----------------------------------------------------------------------------- reading


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bad(path: Path, row: int, field: str, expected: str, value: Any) -> DataError:
    return DataError(f"{path}: row {row}: field '{field}': expected {expected}, got {_short(value)}")


def read_rows(path: str | Path) -> list[dict]:
    """Read the raw rows of one `.parquet` or `.jsonl` file, unchecked, in file order."""
    path = Path(path)
    if path.suffix not in EXTENSIONS:
        raise DataError(f"{path}: unknown dataset extension {path.suffix!r}; expected one of {', '.join(EXTENSIONS)}")
    if not path.is_file():
        raise DataError(f"{path}: no such dataset file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several types for a corrupt file
            raise DataError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    rows = []
    with io.StringIO(_read_utf8(path), newline=None) as f:  # newline=None: lines split as open()'s
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) are not rows
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: row {len(rows)} (line {line_no}): not valid JSON ({err})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: row {len(rows)} (line {line_no}): expected a JSON object, got {_short(row)}")
            rows.append(row)
    return rows


def _read_utf8(path: Path) -> str:
    """The text of `path`; bytes that are not UTF-8 are a DataError naming the line (not a bare UnicodeDecodeError)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise DataError(f"{path}: line {line}: not valid UTF-8 (byte 0x{data[err.start]:02x} at byte {column} of the "
                        "line); expected a UTF-8 text file") from None


def check_row(row: Mapping, path: Path, row_idx: int, prompt_key: str = "prompt") -> None:
    """Raise a `DataError` naming file, row and field if `row` does not fit the schema."""
    for field in ("data_source", prompt_key, "ability", "reward_model"):
        if field not in row or row[field] is None:
            raise DataError(f"{path}: row {row_idx}: missing field '{field}'")
    if not isinstance(row["data_source"], str) or not row["data_source"]:
        raise _bad(path, row_idx, "data_source", "a non-empty string", row["data_source"])
    if not isinstance(row["ability"], str):
        raise _bad(path, row_idx, "ability", "a string", row["ability"])

    messages = row[prompt_key]
    if not isinstance(messages, list) or not messages:
        raise _bad(path, row_idx, prompt_key, "a non-empty list of chat messages", messages)
    for j, msg in enumerate(messages):
        where = f"{prompt_key}[{j}]"
        if not isinstance(msg, dict):
            raise _bad(path, row_idx, where, 'a message {"role": str, "content": str}', msg)
        for key in ("role", "content"):
            if key not in msg or msg[key] is None:
                raise DataError(f"{path}: row {row_idx}: field '{where}.{key}': missing")
            if not isinstance(msg[key], str):
                raise _bad(path, row_idx, f"{where}.{key}", "a string", msg[key])
        if not msg["role"]:
            raise _bad(path, row_idx, f"{where}.role", "a non-empty string", msg["role"])

    rm = row["reward_model"]
    if not isinstance(rm, dict):
        raise _bad(path, row_idx, "reward_model", '{"style": ..., "ground_truth": ...}', rm)
    if rm.get("style") not in REWARD_STYLES:
        raise _bad(path, row_idx, "reward_model.style", f"one of {REWARD_STYLES}", rm.get("style"))
    gt = rm.get("ground_truth")
    if rm["style"] == "rule" and not isinstance(gt, str):
        raise _bad(path, row_idx, "reward_model.ground_truth", "a string (style 'rule')", gt)
    if rm["style"] == "model" and gt is not None and not isinstance(gt, str):
        raise _bad(path, row_idx, "reward_model.ground_truth", "a string or null", gt)

    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise _bad(path, row_idx, "extra_info", "a dict or absent", extra)


# ----------------------------------------------------------------------------- dataset


@dataclass(frozen=True)
class PromptRow:
    """One prompt, ready for rollout."""

    index: int  # position in the concatenated files; stable through filtering
    prompt_ids: list[int]  # [P] chat-templated prompt ending in the generation prompt
    messages: list[dict]  # the raw chat messages (not truncated)
    data_source: str
    ability: str
    reward_style: str  # "rule" or "model"
    ground_truth: str | None
    extra_info: dict


def _check_scorable(row: Mapping, path: Path, row_idx: int, check_ground_truth: Callable[[str, str], None] | None,
                    known_sources: Collection[str] | None) -> None:
    """A DataError naming file, row and field if the rule reward could only score the row 0
    (see `PromptDataset`'s `check_ground_truth` and `known_sources`)."""
    if known_sources is not None and row["data_source"] not in known_sources:
        raise DataError(
            f"{path}: row {row_idx}: field 'data_source': no built-in rule reward scores {row['data_source']!r} "
            f"(reward.fn=null picks one by data_source); known: {', '.join(known_sources)}; or set reward.fn to a "
            "function of yours"
        )
    rm = row["reward_model"]
    if check_ground_truth is not None and rm["style"] == "rule":
        try:
            check_ground_truth(row["data_source"], rm["ground_truth"])
        except ValueError as err:
            raise DataError(f"{path}: row {row_idx}: field 'reward_model.ground_truth': {err}") from None


def template_ids(tokenizer: Any, messages: list[dict], template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """A prompt's ids: `messages` through the tokenizer's chat template, with the generation
    prompt and `template_kwargs` (the tools' schemas, `tools=`, for the tool loop)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **(template_kwargs or {}))
    # transformers 5 returns a BatchEncoding, 4.x a plain list.
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


class PromptDataset:
    """Prompt rows from one or more files, chat-templated and length-checked.

    Args:
        paths: one file or several; several are concatenated in the order given.
        tokenizer: an HF tokenizer with a chat template.
        max_prompt_length: the most prompt tokens allowed; None for no limit.
        overlong: what to do with a longer prompt: "error" (a DataError naming file, row
            and lengths), "filter" (drop the row), "truncate_left" (keep the last
            tokens), "truncate_right" (keep the first tokens).
        prompt_key: the field that holds the chat messages.
        check_ground_truth: called as `check_ground_truth(data_source, ground_truth)` for
            every row of reward style "rule"; a ValueError it raises becomes a DataError
            naming file, row and field (the trainer passes `rewards.check_ground_truth`
            when the built-in rule rewards score the run).
        known_sources: the data sources a row may name, None for any; another is a
            DataError naming file, row and value (the trainer passes `rewards.REWARD_FNS`
            when the built-in rule rewards score the run: a source they do not know would
            score 0 on every sample).
        template_kwargs: more keywords of the chat template (`template_ids`).

    `stats` counts rows read, kept, overlong, filtered and truncated; one log line says
    the same. `dataset[i]` is a `PromptRow`; `i` is a position, `dataset[i].index` the
    row's stable index.
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        tokenizer: Any,
        max_prompt_length: int | None,
        overlong: str = "error",
        prompt_key: str = "prompt",
        check_ground_truth: Callable[[str, str], None] | None = None,
        known_sources: Collection[str] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if overlong not in OVERLONG_MODES:
            raise ConfigError(f"overlong={overlong!r}: expected one of {', '.join(OVERLONG_MODES)}")
        if max_prompt_length is not None and (not isinstance(max_prompt_length, int) or max_prompt_length < 1):
            raise ConfigError(f"max_prompt_length={max_prompt_length!r}: expected a positive integer or None")
        paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
        if not paths:
            raise DataError("no dataset files given")

        self.paths = paths
        self.rows: list[PromptRow] = []
        self.stats = {"rows": 0, "kept": 0, "overlong": 0, "filtered": 0, "truncated": 0}
        for path in paths:
            for row_idx, raw in enumerate(read_rows(path)):
                index = self.stats["rows"]  # position in the concatenated files
                self.stats["rows"] += 1
                check_row(raw, path, row_idx, prompt_key)
                _check_scorable(raw, path, row_idx, check_ground_truth, known_sources)
                rm = raw["reward_model"]
                ids = template_ids(tokenizer, raw[prompt_key], template_kwargs)
                if max_prompt_length is not None and len(ids) > max_prompt_length:
                    self.stats["overlong"] += 1
                    if overlong == "error":
                        raise DataError(
                            f"{path}: row {row_idx}: prompt is {len(ids)} tokens, over max_prompt_length="
                            f"{max_prompt_length} (overlong='error'; 'filter' or 'truncate_left' handle it)"
                        )
                    if overlong == "filter":
                        self.stats["filtered"] += 1
                        continue
                    ids = ids[-max_prompt_length:] if overlong == "truncate_left" else ids[:max_prompt_length]
                    self.stats["truncated"] += 1
                self.rows.append(
                    PromptRow(
                        index=index,
                        prompt_ids=ids,
                        messages=raw[prompt_key],
                        data_source=raw["data_source"],
                        ability=raw["ability"],
                        reward_style=rm["style"],
                        ground_truth=rm.get("ground_truth"),
                        extra_info=raw.get("extra_info") or {},
                    )
                )
        self.stats["kept"] = len(self.rows)
        logger.info(
            "dataset %s: %d rows, %d over max_prompt_length=%s (%s), %d filtered, %d truncated, %d kept",
            ", ".join(map(str, paths)),
            self.stats["rows"],
            self.stats["overlong"],
            max_prompt_length,
            overlong,
            self.stats["filtered"],
            self.stats["truncated"],
            len(self.rows),
        )
        if not self.rows:
            raise DataError(f"dataset {', '.join(map(str, paths))}: no rows left ({self.stats})")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        return self.rows[i]


# ----------------------------------------------------------------------------- order


def stable_permutation(n: int, *key: int) -> np.ndarray:
    """A permutation of range(n) that is a pure function of (n, key).

    `Generator.permutation` may change between numpy versions; the raw output of PCG64
    seeded through SeedSequence does not. So: one raw 64-bit draw per item, stable argsort.
    SeedSequence ignores trailing zeros: keys (s, 0) and (s,) give the same permutation.

    Returns:
        [n] int64 array.
    """
    bits = np.random.PCG64(np.random.SeedSequence(list(key)))
    return np.argsort(bits.random_raw(n), kind="stable").astype(np.int64)


class PromptSampler:
    """Batches of dataset positions, epoch after epoch, forever; checkpointable.

    The order of epoch e is `stable_permutation(num_rows, seed, e)` (or range(num_rows)
    without shuffle). With drop_last the rows left over at the end of an epoch are
    skipped; without it the last batch of an epoch is shorter.
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True):
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size}: expected a positive integer")
        if seed < 0:
            raise ConfigError(f"seed={seed}: expected a non-negative integer")
        if num_rows < (batch_size if drop_last else 1):
            raise DataError(
                f"the dataset has {num_rows} rows, fewer than one batch of {batch_size} (drop_last={drop_last})"
            )
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.offset = 0  # rows of the current epoch already served
        self._order: np.ndarray | None = None  # [num_rows] order of self.epoch, cached

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """[num_rows] the positions of `epoch` in serving order."""
        if not self.shuffle:
            return np.arange(self.num_rows, dtype=np.int64)
        return stable_permutation(self.num_rows, self.seed, epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        batch = self._order[self.offset : self.offset + self.batch_size].tolist()
        self.offset += len(batch)
        remaining = self.num_rows - self.offset
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch, self.offset, self._order = self.epoch + 1, 0, None
        return batch

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch, plus the settings it is only valid for."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "num_rows": self.num_rows,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "drop_last": int(self.drop_last),
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from `state`; a state from other settings is refused (it would serve other batches)."""
        for key in ("num_rows", "batch_size", "seed", "shuffle", "drop_last"):
            if int(state[key]) != int(getattr(self, key)):
                raise ConfigError(
                    f"sampler checkpoint has {key}={state[key]} but this run has {key}={getattr(self, key)}; "
                    "resuming would serve different batches"
                )
        self.epoch, self.offset, self._order = int(state["epoch"]), int(state["offset"]), None
