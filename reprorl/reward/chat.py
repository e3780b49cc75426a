"""What every reward-model backend shares: (chat prompt, response text) -> the reward
model's own token ids -> scores.

`RewardModelScorer` (reward_model.py, the built-in engine) and `VllmRewardScorer`
(vllm_reward.py) both derive from `ChatScorer`; this module imports neither, so the two
backends do not import each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def chat_input_ids(tokenizer: Any, prompt: Sequence[Mapping[str, str]], response: str) -> list[int]:
    """A reward model's token ids of the chat `prompt + [assistant: response]`, by its own
    template (the RM may tokenize differently from the policy). Every RM backend uses it."""
    messages = [*prompt, {"role": "assistant", "content": response}]
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


class ChatScorer:
    """What every reward-model backend shares: chat pairs -> its own token ids -> `score_ids`.
    A subclass sets `self.tokenizer` and defines `score_ids(sequences) -> [B] float32`."""

    tokenizer: Any

    def input_ids(self, prompt: Sequence[Mapping[str, str]], response: str) -> list[int]:
        """The RM's token ids of the chat `prompt + [assistant: response]`, by its own template."""
        return chat_input_ids(self.tokenizer, prompt, response)

    def score(self, prompts: Sequence[Sequence[Mapping[str, str]]], responses: Sequence[str]) -> torch.Tensor:
        """[B] float32 scores of the pairs (prompts[i] chat messages, responses[i] text), in order."""
        if len(prompts) != len(responses):
            raise ValueError(f"score: {len(prompts)} prompts but {len(responses)} responses")
        return self.score_ids([self.input_ids(p, r) for p, r in zip(prompts, responses)])

    def score_ids(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        raise NotImplementedError
