"""`reprorl export RUN_DIR OUT_DIR [--step N] [--merged]`: a run's policy for other tools.

A checkpoint holds the actor's trainable parameters as float32 master shards (`actor.shards/`,
any number of files: workers/worker.py) and the run's config in `meta.json`. The export
rebuilds the policy the run computed with: the base model of `model.path` (or `--base`),
its trainable parameters taken from the shards and cast to `model.dtype` (the same cast the
workers make after each step, so the weights are those that produced the run's rollouts).

- full fine-tuning: an HF model directory (config.json, model.safetensors and the base's
  tokenizer files) that transformers loads;
- LoRA (`model.lora_rank` > 0): a PEFT adapter directory (adapter_config.json,
  adapter_model.safetensors, the tokenizer files) for `PeftModel.from_pretrained` on the
  base; with `merged`, an HF model directory with `W + B A * scaling` in each adapted weight.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from reprorl.errors import ReproRLError
from reprorl.io import atomic_write
from reprorl.models.hf_io import dtype_from_name, load_model, save_model
from reprorl.models.lora import LoraSpec, merged_state, peft_config, peft_state, resolve_targets
from reprorl.models.transformer import CausalLM
from reprorl.records.checkpoint import CHECKPOINTS_DIR, checkpoint_problem, find_valid_checkpoint, read_meta

logger = logging.getLogger(__name__)

# Files copied from the model directory next to exported weights: the tokenizer (and
# generation defaults), so the export is a complete HF model directory.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class ExportError(ReproRLError):
    """A run or checkpoint that cannot be exported; the message names the path and what is missing."""


def export(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: int | None = None,
           merged: bool = False, base: str | os.PathLike | None = None) -> Path:
    """Write the policy of `run_dir`'s checkpoint (the newest intact one, or `step`) to
    `out_dir` (see the module docstring for what is written); returns `out_dir`."""
    ckpt = _checkpoint(Path(run_dir), step)
    config = read_meta(ckpt).get("config")
    if not isinstance(config, dict):
        raise ExportError(f"{ckpt}/meta.json holds no run config (a checkpoint of an older reprorl): cannot export")
    base_path = Path(base if base is not None else config["model.path"])
    if not (base_path / "config.json").is_file():
        raise ExportError(f"model.path {str(base_path)!r} (the run's base model) has no config.json here; run "
                          "export where the run was started, or give the base with --base")
    lora = _lora_spec(config)
    if lora is not None and not merged and json.loads((base_path / "config.json").read_text()).get(
            "model_type") == "phi3":
        raise ExportError("a phi3 base holds q/k/v and gate/up as fused projections, which reprorl's adapters "
                          "(on the separate ones) do not map onto as PEFT adapters: export with --merged")
    model, args = load_model(base_path, kind="causal_lm", dtype=dtype_from_name(config["model.dtype"]), lora=lora)
    _load_actor_shards(model, ckpt)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if lora is not None and not merged:
        _save_adapters(model, lora, base_path, out)
    elif lora is not None:
        plain = CausalLM(args, dtype=next(model.parameters()).dtype)
        plain.load_state_dict(merged_state(model))
        save_model(plain, args, out)
    else:
        save_model(model, args, out)
    for name in TOKENIZER_FILES:
        if (base_path / name).is_file():
            shutil.copyfile(base_path / name, out / name)
    what = "LoRA adapters" if lora is not None and not merged else "model"
    logger.info("exported the %s of %s to %s", what, ckpt, out)
    return out


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    if step is None:
        ckpt = find_valid_checkpoint(run_dir)
        if ckpt is None:
            raise ExportError(f"{run_dir} has no checkpoint (trainer.save_freq > 0 writes them): nothing to export")
        return ckpt
    ckpt = run_dir / CHECKPOINTS_DIR / f"step_{step}"
    if not (ckpt / "meta.json").is_file():
        raise ExportError(f"{run_dir} has no complete checkpoint of step {step} ({ckpt})")
    problem = checkpoint_problem(ckpt)
    if problem is not None:
        raise ExportError(f"checkpoint {ckpt} is damaged: {problem}")
    return ckpt


def _lora_spec(config: dict[str, Any]) -> LoraSpec | None:
    rank = int(config.get("model.lora_rank", 0))
    if rank == 0:
        return None
    return LoraSpec(rank, float(config["model.lora_alpha"]), resolve_targets(config["model.target_modules"]),
                    int(config["seed"]))


def _load_actor_shards(model: torch.nn.Module, ckpt: Path) -> None:
    """The actor's trainable parameters from its shard files, laid out as the checkpoint's
    `actor.pt` says (names, shapes, in flat order), cast to the model's dtype."""
    group = torch.load(ckpt / "actor.pt", map_location="cpu", weights_only=True)
    layout = group["layout"]
    flat = torch.empty(layout["numel"], dtype=torch.float32)
    for i in range(group["num_shards"]):
        shard = torch.load(ckpt / "actor.shards" / f"shard_{i}.pt", map_location="cpu", weights_only=True)
        flat[shard["start"] : shard["end"]] = shard["param"]
    params = dict(model.named_parameters())
    trainable = [n for n, p in params.items() if p.requires_grad]
    if list(layout["names"]) != trainable:
        raise ExportError(f"checkpoint {ckpt} holds parameters {list(layout['names'])[:2]}..., not this model's "
                          f"trainable ones {trainable[:2]}...: a checkpoint of another model or LoRA setting")
    offset = 0
    with torch.no_grad():
        for name, shape in zip(layout["names"], layout["shapes"]):
            size = int(torch.Size(shape).numel())
            params[name].copy_(flat[offset : offset + size].view(shape))  # the workers' cast of the master
            offset += size


def _save_adapters(model: torch.nn.Module, lora: LoraSpec, base_path: Path, out: Path) -> None:
    with atomic_write(out / ADAPTER_WEIGHTS) as tmp:
        save_file(peft_state(model), tmp, metadata={"format": "pt"})
    with atomic_write(out / ADAPTER_CONFIG) as tmp:
        tmp.write_text(json.dumps(peft_config(lora, str(base_path.resolve())), indent=2, sort_keys=True) + "\n")
