"""The lookahead path's plan of the next step, without a GPU: it launches step t+1 before
step t's tokens are read only when no sequence can end at t but by a stop token."""

import torch

from reprorl.models.arch import ModelArgs
from reprorl.rollout.lookahead import chunks_after
from reprorl.rollout.sampling import make_generator
from reprorl.rollout.request import SamplingParams
from reprorl.rollout.scheduler import Scheduler, Sequence

ARGS = ModelArgs(model_type="qwen2", vocab_size=32, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                 num_attention_heads=1, num_key_value_heads=1, head_dim=8)


def decoding(*max_tokens):
    """A scheduler whose sequences ("a", "b", ...; one-token prompts) have each sampled one
    token, and their next decode step."""
    s = Scheduler(ARGS, torch.float32, torch.device("cpu"), max_num_seqs=4, max_num_batched_tokens=16,
                  starvation_steps=256, prefix_sharing=True, eos_token_ids=frozenset([2]))
    for i, m in enumerate(max_tokens):
        s.add(Sequence("abcd"[i], [3 + i], SamplingParams(max_tokens=m), make_generator(0), 0, None, 1 + m))
    chunks = s.schedule(weight_version=0)
    s.apply(chunks, [9] * len(chunks), [-1.0] * len(chunks))
    return s, s.schedule(weight_version=0)


def test_the_step_after_decodes_every_sequence_one_position_on():
    _, chunks = decoding(3, 5)
    nxt = chunks_after(chunks)
    assert [(c.seq.request_id, c.slot, c.token_ids, c.start, c.sample) for c in nxt] == [
        ("a", 0, [-1], 2, True), ("b", 1, [-1], 2, True)]  # ids -1: still on the device


def test_no_step_after_one_that_may_end_a_sequence():
    s, chunks = decoding(2, 5)  # a's token of this step is its last (max_tokens)
    assert chunks_after(chunks) is None
    s, chunks = decoding(3, 5)
    s.by_id["b"].aborted = True
    assert chunks_after(chunks) is None
    s.drop(s.by_id["b"])  # gone since (finished or reaped)
    assert chunks_after(chunks) is None
