"""The reward loop: rule functions and served reward models.

    from reprorl.reward import RewardLoop, resolve_reward_fn
    from reprorl.reward.reward_model import RewardModelPool, RewardModelScorer

The reward-model module is imported on its own: it pulls in Ray, transformers and the
model code, which the rule-only path does not need.
"""

from reprorl.reward.loop import RewardLoop, decode_responses
from reprorl.reward.user_fn import resolve_reward_fn

__all__ = ["RewardLoop", "decode_responses", "resolve_reward_fn"]
