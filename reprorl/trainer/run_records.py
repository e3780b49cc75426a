"""What a step leaves in the run directory besides metrics: its fingerprint, its sample
generations, and the determinism report of the parts that ran it.

- `write_fingerprint`: digests of what the step computed and of its new weights
  (fingerprints.jsonl, which `reprorl compare` reads);
- `log_generations`: the first `trainer.log_generations` samples of a batch, as lines of
  generations.jsonl (appended, durably) and as a table in TensorBoard and wandb;
- `report_determinism`: every part's determinism mode, compared and written
  (determinism.json and its text beside it).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from reprorl.determinism_report import build_report, format_report, write_report
from reprorl.fingerprint import FingerprintWriter
from reprorl.protocol import Batch
from reprorl.records.tracking import GENERATIONS_FILE, Tracker

logger = logging.getLogger(__name__)


def write_fingerprint(writer: FingerprintWriter, step: int, batch: Batch, scores: torch.Tensor,
                      metrics: dict[str, float], weight_digests: dict[str, str]) -> None:
    """The step's fingerprint record: digests of what it computed and of the new weights."""
    writer.write(
        step,
        fields={
            "prompts": batch["prompts"], "responses": batch["responses"],
            "rollout_log_probs": batch["rollout_log_probs"], "rewards": scores,
            "old_log_probs": batch["old_log_probs"], "advantages": batch["advantages"],
            **({"ref_log_probs": batch["ref_log_probs"]} if "ref_log_probs" in batch else {}),
            **({"values": batch["values"]} if "values" in batch else {}),
            "losses": torch.tensor([metrics[k] for k in sorted(metrics) if k.endswith("_loss")], dtype=torch.float64),
            "grad_norms": torch.tensor(
                [metrics[k] for k in sorted(metrics) if k.endswith("grad_norm")], dtype=torch.float64
            ),
        },
        param_digests=weight_digests,
    )


def log_generations(run_dir: Path, tracker: Tracker | None, tokenizer: Any, count: int, step: int, split: str,
                    output: Batch, scores: torch.Tensor) -> None:
    """The first `count` samples of `output` (a step's training batch or a validation's first
    batch; `split`: "train" or "val") with their `scores`, to generations.jsonl and `tracker`."""
    lines = []
    for i in range(min(count, len(output))):
        model_tokens = output["response_mask"][i].nonzero()
        length = int(model_tokens[-1]) + 1 if len(model_tokens) else 0  # tool turns between included
        response = output["responses"][i][:length].tolist()
        lines.append({
            "step": step, "split": split, "uid": output.non_tensors["uid"][i],
            "data_source": output.non_tensors["data_source"][i],
            "prompt": tokenizer.decode(list(output.non_tensors["prompt_ids"][i])),
            "response": tokenizer.decode(response), "reward": float(scores[i]),
        })
    with open(run_dir / GENERATIONS_FILE, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())
    if tracker is not None:
        tracker.log_generations(step, split, lines)


def report_determinism(run_dir: Path, parts: Any, *, full_determinism: bool, seed: int, placement: Any,
                       step: int) -> dict[str, Any]:
    """Ask every part of `parts` (parts.py's `Parts`) for its determinism mode; write, log and
    return the report (`step`: where this process started)."""
    infos: dict[str, dict[str, Any]] = {}
    for group in (parts.actor, parts.ref, parts.critic):
        if group is not None:
            infos.update(group.determinism_info())  # "actor worker 0", ...
    infos.update({f"rollout replica {i}": info for i, info in parts.pool.determinism_info().items()})
    if parts.reward_model is not None:
        infos.update({f"reward replica {i}": info for i, info in parts.reward_model.determinism_info().items()})
    infos.update({f"agent-loop worker {i}": info for i, info in parts.agent.determinism_info().items()})
    report = build_report(infos, full_determinism=full_determinism, seed=seed)
    report["started_at_step"] = step
    report["placement"] = placement.summary()
    write_report(run_dir, report)
    logger.info("%s", format_report(report))
    return report
