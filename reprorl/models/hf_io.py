"""Read and write HF-format model directories: config.json + safetensors.

Our modules use transformers' parameter names (`model.layers.0.self_attn.q_proj.weight`,
`lm_head.weight`, `score.weight`), so loading is a name-by-name copy with checks, and a
saved directory loads in transformers and vLLM. Tokenizers are transformers'
(`AutoTokenizer`), through `load_tokenizer`, which gives every part the same pad token.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from reprorl.errors import CheckpointError
from reprorl.io import atomic_write
from reprorl.models.arch import ModelArgs
from reprorl.models.fused import join_fused, split_fused
from reprorl.models.lora import LoraSpec, add_adapters
from reprorl.models.transformer import CausalLM, SequenceClassifier, ValueModel

MODEL_CLASSES = {"causal_lm": CausalLM, "reward": SequenceClassifier, "critic": ValueModel}
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def dtype_from_name(name: str | torch.dtype | None) -> torch.dtype | None:
    """"float32" / "bfloat16" (config values) -> torch dtype; a dtype or None passes."""
    if name is None or isinstance(name, torch.dtype):
        return name
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of {', '.join(dtypes)}; got {name!r}")
    return dtypes[name]


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of an HF directory, padding with eos when it has no pad token.

    Many base models (Llama 3's among them) ship without a pad token; the rollout pads
    prompts and responses with one, always under an attention mask, so any id does and
    eos is the usual choice (as in verl and TRL). Every part that pads loads its tokenizer
    here, so all of them pad alike. Without a pad token and without eos, `pad_token_id`
    stays None, and the trainer's start-up check names the path.
    """
    from transformers import AutoTokenizer  # here: its auto classes cost seconds at import

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    path: str | os.PathLike, *, kind: str = "causal_lm", dtype: torch.dtype | None = None,
    lora: LoraSpec | None = None,
) -> tuple[nn.Module, ModelArgs]:
    """Load an HF-format directory as `kind`: "causal_lm" | "reward" | "critic".

    dtype: None keeps config.json's torch_dtype. `lora`: a causal LM gets LoRA adapters
    (models/lora.py; the base frozen). Returns (model, args).
    Allowed differences between checkpoint and model, everything else is an error:
    - `lm_head.weight` is ignored when embeddings are tied, and for reward/critic models
      (so a critic or reward model can start from a policy checkpoint);
    - a critic's `score.weight`/`score.bias` may be absent: a critic starting from a policy
      gets a zero value head (value 0 everywhere), one starting from a reward model takes
      its `score.weight` and a zero bias.
    """
    if kind not in MODEL_CLASSES:
        raise ValueError(f"kind {kind!r}; expected one of {sorted(MODEL_CLASSES)}")
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model path {path} does not exist or is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"model path {path} has no config.json")
    args = ModelArgs.from_hf_config(json.loads(config_file.read_text()))
    model = MODEL_CLASSES[kind](args, dtype)
    _copy_tensors(model, split_fused(_read_tensors(path), args), kind, path)
    if lora is not None:
        if kind != "causal_lm":
            raise ValueError(f"load_model: LoRA adapters are for the policy (kind causal_lm), not {kind!r}")
        add_adapters(model, lora)
    return model, args


def save_model(model: nn.Module, args: ModelArgs, out_dir: str | os.PathLike) -> Path:
    """Write `model` as config.json + model.safetensors under HF names; returns out_dir.

    Each file is written with `reprorl.io.atomic_write`, so a reader never sees half a
    file. Other files in out_dir are left alone.
    """
    kind = next((k for k, cls in MODEL_CLASSES.items() if type(model) is cls), None)
    if kind is None:
        raise TypeError(
            f"cannot save a {type(model).__name__}; expected one of CausalLM, SequenceClassifier, ValueModel"
        )
    tensors = join_fused({name: t.detach().contiguous() for name, t in model.state_dict().items()}, args)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    config = dataclasses.replace(args, torch_dtype=dtype).to_hf_config(kind)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_write(out_dir / WEIGHTS_FILE) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    with atomic_write(out_dir / "config.json") as tmp:
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def _read_tensors(path: Path) -> dict[str, Tensor]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    if (path / WEIGHTS_FILE).is_file():
        return load_file(path / WEIGHTS_FILE)
    index_file = path / INDEX_FILE
    if not index_file.is_file():
        raise CheckpointError(f"model path {path} has no {WEIGHTS_FILE} and no {INDEX_FILE}")
    weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
    tensors: dict[str, Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise CheckpointError(f"{index_file} lists shard {shard}, which does not exist")
        tensors.update(load_file(path / shard))
    listed_missing = sorted(set(weight_map) - set(tensors))
    if listed_missing:
        raise CheckpointError(
            f"{index_file} maps {listed_missing[0]} to {weight_map[listed_missing[0]]}, which lacks it"
        )
    return tensors


def _copy_tensors(model: nn.Module, tensors: dict[str, Tensor], kind: str, path: Path) -> None:
    params = model.state_dict()
    ignored = {name for name in tensors if name.endswith("rotary_emb.inv_freq")}
    if kind != "causal_lm" or model.args.tie_word_embeddings:
        ignored.add("lm_head.weight")
    optional = {"score.weight", "score.bias"} if kind == "critic" else set()
    missing = sorted(set(params) - set(tensors) - optional)
    unexpected = sorted(set(tensors) - set(params) - ignored)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {path} lacks tensor {missing[0]}{more} needed by a {kind} model")
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(
            f"checkpoint {path} has tensor {unexpected[0]}{more}, "
            f"which a {kind} model of this config.json does not have"
        )
    with torch.no_grad():
        for name, param in params.items():
            if name not in tensors:
                continue  # an optional critic head: stays zero
            if tensors[name].shape != param.shape:
                raise CheckpointError(
                    f"tensor {name} in {path} has shape {list(tensors[name].shape)}, "
                    f"expected {list(param.shape)} from config.json"
                )
            param.copy_(tensors[name])


def eos_ids_from_dir(path: str) -> int | list[int] | None:
    """eos_token_id from generation_config.json, else config.json (HF's own precedence)."""
    for name in ("generation_config.json", "config.json"):
        f = os.path.join(path, name)
        if os.path.exists(f):
            with open(f) as fh:
                eos = json.load(fh).get("eos_token_id")
            if eos is not None:
                return eos
    return None
