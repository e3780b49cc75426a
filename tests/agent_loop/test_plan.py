"""The manager's pure parts: per-sample identity and params, worker chunks, padding."""

import numpy as np
import pytest
import torch

from reprorl.agent_loop.manager import assemble, greedy_params, plan_samples, split_contiguous
from reprorl.agent_loop.request import rollout_requests
from reprorl.agent_loop.single_turn import AgentOutput
from reprorl.determinism import request_seed
from reprorl.errors import DataError
from reprorl.protocol import Batch
from reprorl.rollout.request import SamplingParams

TRAIN = SamplingParams(temperature=0.9, top_p=0.8, top_k=20, max_tokens=3)
VAL = SamplingParams(temperature=0.5, max_tokens=3)


def _batch(validate=False):
    cols = {
        "uid": ["a", "a", "b"],
        "repeat_index": [0, 1, 0],
        "prompt_ids": [[5, 6], [5, 6], [7]],
        "data_source": ["x", "x", "y"],
    }
    return Batch(non_tensors=cols, meta={"step": 4, "validate": validate})


def _plan(batch, do_sample=None):
    return plan_samples(rollout_requests(batch, do_sample), run_seed=9, sampling_params=TRAIN, val_sampling_params=VAL, max_response_length=16)


def test_plan_identity_seeds_and_priorities():
    samples = _plan(_batch())
    assert [s.index for s in samples] == [0, 1, 2]
    assert [s.request_id for s in samples] == ["train/4/a/0", "train/4/a/1", "train/4/b/0"]
    assert [s.prompt_ids for s in samples] == [[5, 6], [5, 6], [7]]
    assert [s.seed(0) for s in samples] == [request_seed(9, 4, "a", 0), request_seed(9, 4, "a", 1),
                                            request_seed(9, 4, "b", 0)]
    assert samples[0].seed(2) == request_seed(9, 4, "a", 0, 2)
    assert len({s.seed(0) for s in samples}) == 3
    assert all(s.sampling_params == SamplingParams(0.9, 0.8, 20, max_tokens=3) for s in samples)
    assert [s.extra for s in samples] == [{"data_source": "x"}, {"data_source": "x"}, {"data_source": "y"}]


def test_rows_become_typed_requests():
    from reprorl.agent_loop.request import RolloutRequest

    requests = rollout_requests(_batch(validate=True), do_sample=[True, False, True])
    assert requests[1] == RolloutRequest(uid="a", repeat_index=1, step=4, phase="val", prompt_ids=[5, 6],
                                         do_sample=False, extra={"data_source": "x"})
    assert [r.request_id for r in requests] == ["val/4/a/0", "val/4/a/1", "val/4/b/0"]


def test_plan_keeps_max_tokens_and_refuses_more_than_the_response_width():
    """rollout.max_tokens bounds the responses (it was overwritten by max_response_length)."""
    samples = _plan(_batch())
    assert [s.sampling_params.max_tokens for s in samples] == [3, 3, 3]
    with pytest.raises(ValueError, match="max_tokens=17 is more than max_response_length=16"):
        plan_samples(rollout_requests(_batch()), run_seed=9, sampling_params=SamplingParams(max_tokens=17), val_sampling_params=VAL,
                     max_response_length=16)


def test_plan_validation_uses_its_params_and_phase():
    samples = _plan(_batch(validate=True))
    assert samples[0].request_id == "val/4/a/0"
    assert samples[0].seed(0) == request_seed(9, 4, "a", 0, phase="val") != request_seed(9, 4, "a", 0)
    assert samples[0].sampling_params == SamplingParams(temperature=0.5, max_tokens=3)


def test_plan_do_sample_rows_are_greedy():
    samples = _plan(_batch(), do_sample=[True, False, True])
    greedy = SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=3)
    assert greedy_params(TRAIN.__class__(0.9, 0.8, 20, max_tokens=3)) == greedy
    assert [s.sampling_params for s in samples] == [SamplingParams(0.9, 0.8, 20, max_tokens=3), greedy,
                                                   SamplingParams(0.9, 0.8, 20, max_tokens=3)]
    assert all(s.extra == {"data_source": s.extra["data_source"]} for s in samples)


def test_plan_errors():
    with pytest.raises(DataError, match=r"rows 0 and 1 have the same \(uid, repeat_index\) = \('a', 0\)"):
        _plan(Batch(non_tensors={"uid": ["a", "a"], "repeat_index": [0, 0], "prompt_ids": [[1], [1]]},
                    meta={"step": 0}))
    with pytest.raises(DataError, match="meta 'step'=None: expected an int"):
        _plan(Batch(non_tensors={"uid": ["a"], "repeat_index": [0], "prompt_ids": [[1]]}))
    with pytest.raises(DataError, match="needs a non-tensor column 'raw_prompt' or 'prompt_ids'"):
        _plan(Batch(non_tensors={"uid": ["a"], "repeat_index": [0]}, meta={"step": 0}))
    with pytest.raises(DataError, match="row 1: do_sample=1, expected true or false"):
        _plan(_batch(), do_sample=[True, 1, True])
    with pytest.raises(ValueError, match="do_sample has 2 flags for a rollout batch of 3 rows"):
        _plan(_batch(), do_sample=[True, False])


def test_raw_prompt_rows_keep_their_messages():
    msgs = [{"role": "user", "content": "1+1?"}]
    b = Batch(non_tensors={"uid": ["q"], "repeat_index": np.array([0]), "raw_prompt": [msgs]}, meta={"step": 0})
    (s,) = _plan(b)
    assert s.prompt_ids is None and s.raw_prompt == msgs


def test_split_contiguous():
    assert split_contiguous(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_contiguous(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert split_contiguous(2, 3) == [(0, 1), (1, 2)]
    assert split_contiguous(0, 3) == [(0, 0)]


def test_assemble_literal():
    outs = [
        AgentOutput([5, 6], [10, 11, 2], [1, 1, 1], [-0.5, -0.25, -1.0], 1, "stop"),
        AgentOutput([7], [12, 30, 13], [1, 0, 1], [-2.0, 0.0, -3.0], 2, "length"),
        AgentOutput([8, 9, 4], [], [], [], 1, "length"),
    ]
    t = assemble(outs, pad_token_id=0, max_response_length=4)
    assert torch.equal(t["prompts"], torch.tensor([[0, 5, 6], [0, 0, 7], [8, 9, 4]]))
    assert torch.equal(t["responses"], torch.tensor([[10, 11, 2, 0], [12, 30, 13, 0], [0, 0, 0, 0]]))
    assert torch.equal(t["response_mask"], torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]]))
    assert torch.equal(t["rollout_log_probs"], torch.tensor([[-0.5, -0.25, -1.0, 0.0], [-2.0, 0.0, -3.0, 0.0],
                                                             [0.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(t["input_ids"], torch.tensor([[0, 5, 6, 10, 11, 2, 0], [0, 0, 7, 12, 30, 13, 0],
                                                     [8, 9, 4, 0, 0, 0, 0]]))
    assert torch.equal(t["attention_mask"], torch.tensor([[0, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 0],
                                                          [1, 1, 1, 0, 0, 0, 0]]))
    assert torch.equal(t["position_ids"], torch.tensor([[0, 0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3, 3],
                                                        [0, 1, 2, 2, 2, 2, 2]]))
    assert t["rollout_log_probs"].dtype == torch.float32
    # A fixed prompt width pads further; a longer prompt is an error naming the row.
    assert assemble(outs, pad_token_id=0, max_response_length=4, max_prompt_length=5)["prompts"].shape == (3, 5)
    with pytest.raises(DataError, match="row 2: prompt of 3 tokens is longer than max_prompt_length=2"):
        assemble(outs, pad_token_id=0, max_response_length=4, max_prompt_length=2)


def test_plan_rejects_unknown_agent_name():
    b = _batch()
    b["agent_name"] = ["tool", "single_turn", "react"]
    with pytest.raises(DataError, match="row 2: agent_name='react', expected one of"):
        _plan(b)
    b["agent_name"] = ["tool", "single_turn", "tool"]
    assert [s.extra["agent_name"] for s in _plan(b)] == ["tool", "single_turn", "tool"]
