"""The fit loop's length metrics, on a hand-made rollout batch."""

import torch

from reprorl.protocol import Batch
from reprorl.trainer.fit import length_metrics


def test_length_metrics_by_hand():
    # Prompts of 2, 3 and 1 tokens, left-padded to 3; responses of 3 (1 of them a tool
    # token, mask 0), 1 and 4 model tokens, right-padded to 4.
    prompt_attention = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    response_attention = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    batch = Batch(
        {"prompts": torch.zeros(3, 3, dtype=torch.long),
         "attention_mask": torch.cat([prompt_attention, response_attention], dim=1),
         "response_mask": torch.tensor([[1, 0, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])},
        {"finish_reason": ["stop", "stop", "length"]},
    )
    assert length_metrics(batch) == {
        "response_length/mean": 2.3333332538604736,  # model tokens 2, 1, 4: 7 / 3 in float32
        "response_length/max": 4.0,
        "response_length/min": 1.0,
        "response_length/clip_ratio": 1 / 3,
        "prompt_length/mean": 2.0,  # 2, 3, 1
        "prompt_length/max": 3.0,
    }
