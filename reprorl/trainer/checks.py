"""The start-up checks of a run: every input a run needs, checked before any model loads
or Ray actor starts, each failure a one-line `ConfigError` naming the key and what was
expected.

    check_paths(cfg)                    model and data paths exist
    check_models(cfg, tokenizer)        each model can serve this run (vocab, positions, eos)
    check_train_set_size(cfg, n)        the train set holds one batch
    warn_if_stale_on_shared_gpu(cfg)    bounded staleness with the replicas on the trainer's GPUs (a
                                        warning at fit's start: the run goes on)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from reprorl.algos.registry import estimator
from reprorl.config import Config
from reprorl.errors import ConfigError
from reprorl.models.arch import ModelArgs
from reprorl.models.hf_io import eos_ids_from_dir
from reprorl.resources.placement import resolve_device

logger = logging.getLogger(__name__)


def check_paths(cfg: Config) -> None:
    """Fail before any work starts if a model or data path does not exist, naming the key."""
    models = {"model.path": cfg.model.path, "model.ref_path": cfg.model.ref_path}
    if estimator(cfg.algorithm.adv_estimator).needs_critic:
        models["model.critic_path"] = cfg.model.critic_path
    if cfg.reward.model_path is not None:
        models["reward.model_path"] = cfg.reward.model_path
    for key, path in models.items():
        if not (Path(path) / "config.json").is_file():
            what = "does not exist" if not Path(path).exists() else "has no config.json"
            raise ConfigError(f"{key}: {path!r} {what}; expected a HF-format model directory")
    for key in ("train_files", "val_files"):
        for path in getattr(cfg.data, key):
            if not Path(path).is_file():
                raise ConfigError(f"data.{key}: {path!r} does not exist")


def _model_args(key: str, path: str) -> ModelArgs:
    """The shape config.json gives the model at `path` (config key `key`), read without loading weights."""
    try:
        return ModelArgs.from_hf_config(json.loads((Path(path) / "config.json").read_text(encoding="utf-8")))
    except ConfigError as err:  # a model type or setting reprorl's models do not support
        raise ConfigError(f"{key}: {path!r}: {err}") from None
    except KeyError as err:
        raise ConfigError(f"{key}: {path!r} config.json has no {err}") from None
    except ValueError as err:  # not JSON
        raise ConfigError(f"{key}: {path!r} config.json is not valid JSON: {err}") from None


def check_models(cfg: Config, tokenizer: Any) -> None:
    """Fail before any model loads or Ray actor starts if a model cannot serve this run.

    `tokenizer` is model.path's. Every model that reads its token ids (actor and rollout,
    reference, critic) needs `vocab_size` >= the tokenizer's size (larger is normal:
    padded embeddings, as in Qwen) and positions for a whole prompt plus response
    (`data.max_prompt_length + data.max_response_length`); the tokenizer needs a pad
    token (the rollout pads with it; `load_tokenizer` falls back to eos), and the eos ids
    the engine stops on must be ids the model can produce. A reward model is checked
    against its own tokenizer.
    """
    data = cfg.data
    length = data.max_prompt_length + data.max_response_length
    if tokenizer.pad_token_id is None:
        raise ConfigError(f"model.path: the tokenizer in {cfg.model.path!r} has neither a pad token nor an eos "
                          "token; expected one of them (set pad_token in its tokenizer_config.json)")
    models = {"model.path": cfg.model.path}
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        models["model.ref_path"] = cfg.model.ref_path
    if estimator(cfg.algorithm.adv_estimator).needs_critic:
        models["model.critic_path"] = cfg.model.critic_path
    num_tokens = len(tokenizer)
    shapes = {key: _model_args(key, path) for key, path in models.items()}
    for key, path in models.items():
        args = shapes[key]
        if args.vocab_size < num_tokens:
            raise ConfigError(
                f"{key}: {path!r} has vocab_size={args.vocab_size} in config.json but the tokenizer of model.path "
                f"has {num_tokens} tokens; expected vocab_size >= {num_tokens} (a model and the tokenizer it was "
                "trained with)"
            )
        if length > args.max_position_embeddings:
            raise ConfigError(
                f"data.max_prompt_length + data.max_response_length = {data.max_prompt_length} + "
                f"{data.max_response_length} = {length} tokens is more than {key} {path!r} holds "
                f"(max_position_embeddings={args.max_position_embeddings}); expected at most "
                f"{args.max_position_embeddings}"
            )
    vocab_size = shapes["model.path"].vocab_size
    eos = eos_ids_from_dir(cfg.model.path)  # the ids the engine stops at
    for token_id in [eos] if isinstance(eos, int) else eos or []:
        if not 0 <= token_id < vocab_size:
            raise ConfigError(
                f"model.path: {cfg.model.path!r} stops generation at eos_token_id={token_id} "
                f"(generation_config.json or config.json), which its vocab_size={vocab_size} cannot produce; "
                f"expected an id in [0, {vocab_size})"
            )
    if cfg.reward.model_path is not None:
        _check_reward_model(cfg.reward.model_path, length)


def _check_reward_model(path: str, length: int) -> None:
    """reward.model_path against its own tokenizer; `length` is the policy's prompt + response tokens."""
    args = _model_args("reward.model_path", path)
    num_rm_tokens = len(AutoTokenizer.from_pretrained(path))
    if args.vocab_size < num_rm_tokens:
        raise ConfigError(
            f"reward.model_path: {path!r} has vocab_size={args.vocab_size} in config.json but its tokenizer has "
            f"{num_rm_tokens} tokens; expected vocab_size >= {num_rm_tokens}"
        )
    if args.max_position_embeddings < length:
        # Not an error: the reward model re-tokenizes the text with its own tokenizer (and
        # chat template), which may need fewer tokens than the policy's; a sample that
        # does not fit fails the step with the sample's length, after the last checkpoint.
        logger.warning(
            "reward.model_path: %r has max_position_embeddings=%d, fewer than "
            "data.max_prompt_length + data.max_response_length = %d policy tokens: long samples may not fit",
            path, args.max_position_embeddings, length)


def check_train_set_size(cfg: Config, num_prompts: int) -> None:
    """Fail if the train set (`num_prompts` after overlong handling) holds less than one batch."""
    if num_prompts < cfg.data.train_batch_size:
        raise ConfigError(
            f"data.train_batch_size={cfg.data.train_batch_size} is larger than the train set "
            f"({num_prompts} prompts after overlong handling)"
        )


def warn_if_stale_on_shared_gpu(cfg: Config) -> None:
    """Bounded staleness with the replicas on the trainer's GPUs was measured to lose (CUDA
    runs two processes' kernels in turns: docs/performance.md); say so, the run goes on."""
    if resolve_device(cfg.resources.device) == "cuda" and cfg.resources.rollout_gpus == 0:
        logger.warning(
            "trainer.max_staleness=%d with resources.rollout_gpus=0: the replicas share the trainer's GPUs, "
            "where overlap was measured slower than trainer.max_staleness=0 (1.59x at the 0.5B shape on an H100); "
            "give the replicas GPUs of their own for the overlap to pay", cfg.trainer.max_staleness)
