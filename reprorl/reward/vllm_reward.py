"""A reward model served by vLLM's pooling (classification) path (`reward.backend=vllm`).

`VllmRewardScorer` answers what `RewardModelScorer` answers (`input_ids`, `score`,
`score_ids`, `batch_invariant`, `dtype`) so `RewardReplica` holds either. The score is the
classification head's raw output at the last token (`use_activation=False`: no sigmoid),
the same number the built-in scorer gives.

Determinism follows the rollout backend (`reprorl.rollout.vllm_replica`; the engine set-up both share: `reprorl.actors.vllm_engine`): the run's
environment is checked inside vLLM's worker at start; without batch invariance (vLLM's CPU
build) determinism mode scores one sequence per forward (`max_num_seqs=1`, one warning per
pool), so a score never depends on the batch around it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from reprorl.determinism import is_full_determinism
from reprorl.errors import ReproRLError
from reprorl.reward.chat import ChatScorer
from reprorl.actors.vllm_engine import (WORKER_ENV_KEYS, engine_kwargs, vllm_env, vllm_mode, vllm_part_info,
                                        warn_if_made_eager)


class VllmRewardScorer(ChatScorer):
    """Scores (prompt messages, response) pairs with vLLM's `LLM(runner="pooling")`.

    Args:
        model_path: an HF sequence-classification directory with `num_labels` 1 and a
            tokenizer with a chat template (`reprorl make-tiny --kind reward` writes one).
        max_num_seqs, max_num_batched_tokens: vLLM's batching limits (max_num_seqs
            becomes 1 in determinism mode without batch invariance).
        expected_env: the run's `determinism_env`, checked inside vLLM's worker.
        where: names this scorer in errors ("reward replica 0").
        engine options: max_model_len, gpu_memory_utilization, kv_cache_gib, enforce_eager
            (see `reprorl.actors.vllm_engine.engine_kwargs`).
    """

    def __init__(self, model_path: str, *, max_num_seqs: int, max_num_batched_tokens: int,
                 expected_env: Mapping[str, str], where: str = "reward model", **engine_options: Any) -> None:
        import json

        from transformers import AutoTokenizer
        from vllm import LLM
        from vllm.platforms import current_platform

        self.model_path = str(model_path)
        with open(os.path.join(self.model_path, "config.json"), encoding="utf-8") as f:
            num_labels = json.load(f).get("num_labels", 1)
        if num_labels != 1:
            raise ReproRLError(f"reward model {self.model_path}: num_labels={num_labels}; "
                               "a reward model gives one score (num_labels 1)")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.tokenizer.chat_template is None:
            raise ReproRLError(f"reward model {self.model_path}: its tokenizer has no chat template")
        full, cuda = is_full_determinism(), current_platform.is_cuda()
        engine_options = dict(engine_options)
        eager = engine_options.pop("enforce_eager", False)
        self.mode = vllm_mode(full, max_num_seqs, cuda=cuda, enforce_eager=eager)
        warn_if_made_eager(self.mode, eager, where)
        extra_env = vllm_env(full, cuda=cuda, enforce_eager=self.mode["enforce_eager"])
        os.environ.update(extra_env)  # before the engine starts: its processes inherit it
        kwargs = engine_kwargs(self.model_path, runner="pooling", max_num_seqs=self.mode["max_num_seqs"],
                           max_num_batched_tokens=max_num_batched_tokens, prefix_caching=self.mode["prefix_caching"],
                           cuda=cuda, seed=0, enforce_eager=self.mode["enforce_eager"], **engine_options)
        self.llm = LLM(**kwargs)
        worker_env = {**{k: v for k, v in expected_env.items() if k in WORKER_ENV_KEYS}, **extra_env}
        (self.worker_info,) = self.llm.collective_rpc("reprorl_init", args=(worker_env, f"vLLM worker of {where}"))
        self.batch_invariant = self.mode["batch_invariant"]
        self.dtype = getattr(torch, self.worker_info["dtype"])
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def score_ids(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """[B] float32 scores of token-id sequences, in order."""
        from vllm import PoolingParams

        for i, s in enumerate(sequences):
            if len(s) == 0:
                raise ValueError(f"score: sequence {i} is empty")
            if len(s) > self.max_model_len:
                raise ValueError(f"score: sequence {i} has {len(s)} tokens, over the reward model's "
                                 f"max_model_len={self.max_model_len}")
        if not sequences:
            return torch.zeros(0, dtype=torch.float32)
        outputs = self.llm.classify([{"prompt_token_ids": list(s)} for s in sequences],
                                    pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        return torch.tensor([o.outputs.probs[0] for o in outputs], dtype=torch.float32)

    def determinism_info(self) -> dict[str, Any]:
        """This scorer's determinism mode (keys: `reprorl.rollout.replica`), measured in vLLM's worker."""
        (worker,) = self.llm.collective_rpc("reprorl_info")
        return vllm_part_info(worker, self.mode)
