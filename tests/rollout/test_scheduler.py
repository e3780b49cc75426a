"""The engine's scheduler without a model: which chunks a step packs, admission order,
starvation, prefix sharing, finishing, and KV slots. Each test plans steps by hand and feeds
made-up tokens back (`Scheduler.apply`), as the engine does with sampled ones."""

import pytest
import torch

from reprorl.kernels import KEY_BLOCK
from reprorl.models.arch import ModelArgs
from reprorl.rollout.scheduler import Scheduler, Sequence, SlotPool, samplers
from reprorl.rollout.sampling import make_generator
from reprorl.rollout.request import SamplingParams

# The KV cache's shape only: one layer, one head of 8 (no weights are made).
ARGS = ModelArgs(model_type="qwen2", vocab_size=32, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                 num_attention_heads=1, num_key_value_heads=1, head_dim=8)
EOS = 2
CPU = torch.device("cpu")


def scheduler(max_num_seqs=4, max_num_batched_tokens=16, starvation_steps=256, prefix_sharing=True) -> Scheduler:
    return Scheduler(ARGS, torch.float32, CPU, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     starvation_steps=starvation_steps, prefix_sharing=prefix_sharing, eos_token_ids=frozenset([EOS]))


def seq(rid, prompt, priority=0, max_tokens=4, capacity=None, **params) -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), make_generator(0), priority,
                    future=None, capacity=capacity or len(prompt) + max_tokens)


def plan(chunks):
    """A step as (request, token ids, first position, samples)."""
    return [(c.seq.request_id, c.token_ids, c.start, c.sample) for c in chunks]


def step(s: Scheduler, tokens=None):
    """Plan a step and apply it, each sampling sequence getting a token (default 9)."""
    chunks = s.schedule(weight_version=0)
    n = len(samplers(chunks))
    finished = s.apply(chunks, tokens or [9] * n, [-1.0] * n)
    return chunks, finished


def test_a_step_packs_decodes_then_prefill_then_admissions():
    s = scheduler(max_num_batched_tokens=6)
    s.add(seq("a", range(10, 18)))  # 8 prompt tokens
    s.add(seq("b", [20, 21]))
    chunks, _ = step(s)
    assert plan(chunks) == [("a", [10, 11, 12, 13, 14, 15], 0, False)]  # the budget is spent: b waits
    chunks, _ = step(s, [5, 6])
    assert plan(chunks) == [("a", [16, 17], 6, True), ("b", [20, 21], 0, True)]
    chunks, _ = step(s)
    assert plan(chunks) == [("a", [5], 8, True), ("b", [6], 2, True)]  # decodes in slot order
    assert (s.running[0].slot, s.running[1].slot) == (0, 1)


def test_admission_by_priority_then_arrival():
    s = scheduler(max_num_seqs=2)
    for i, (rid, priority) in enumerate([("low", 1), ("first", 0), ("second", 0)]):
        s.add(seq(rid, [3 + i], priority=priority))
    chunks, _ = step(s)
    assert [c.seq.request_id for c in chunks] == ["first", "second"]
    assert [w[2].request_id for w in s.waiting] == ["low"]


@pytest.mark.parametrize("starvation_steps, admitted", [(2, "low"), (100, "high")])
def test_a_starved_request_goes_ahead_of_every_priority(starvation_steps, admitted):
    s = scheduler(max_num_seqs=1, starvation_steps=starvation_steps)
    s.add(seq("hog", [3], max_tokens=10))
    s.add(seq("low", [4], priority=5))  # arrives at step 0, waits behind the hog
    for _ in range(4):
        step(s)
    s.add(seq("high", [5], priority=0))
    _, finished = step(s, [EOS])  # the hog stops at step 5; one slot frees
    assert [(q.request_id, why) for q, why in finished] == [("hog", "stop")]
    chunks, _ = step(s)
    assert [c.seq.request_id for c in chunks] == [admitted]


def test_finish_reasons_and_slots_given_back():
    s = scheduler()
    s.add(seq("eos", [3], max_tokens=5))
    s.add(seq("stop", [3, 4], max_tokens=5, stop_token_ids=(7,)))
    s.add(seq("ignore", [5], max_tokens=2, ignore_eos=True))
    s.add(seq("full", [6, 6, 6], max_tokens=5, capacity=4))  # max_model_len: room for one token
    _, finished = step(s, [EOS, 7, EOS, 8])
    assert [(q.request_id, why) for q, why in finished] == [("eos", "stop"), ("stop", "stop"), ("full", "length")]
    _, finished = step(s, [EOS])
    assert [(q.request_id, why, q.output_ids) for q, why in finished] == [("ignore", "length", [EOS, EOS])]
    assert sorted(s.kv.free) == [0, 1, 2, 3] and not s.running and not s.by_id
    assert s.stats["finished"] == 4 and s.stats["tokens_generated"] == 5


def test_slots_go_lowest_first_and_the_cpu_cache_grows_to_the_longest():
    s = scheduler()
    s.add(seq("a", [3], max_tokens=1))
    s.add(seq("b", [4], max_tokens=KEY_BLOCK + 10))
    step(s)  # a finishes at once: slot 0 is free again
    s.add(seq("c", [5]))
    step(s)
    assert {q.request_id: q.slot for q in s.running} == {"b": 1, "c": 0}
    assert s.kv.cache.capacity == 2 * KEY_BLOCK


def test_a_fixed_cache_with_no_free_slot_makes_admission_wait():
    s = scheduler(max_num_seqs=4)
    s.kv = SlotPool(ARGS, 1, torch.float32, CPU, capacity=KEY_BLOCK)  # a GPU's: one slot (and the spare)
    s.add(seq("a", [3]))
    s.add(seq("b", [4]))
    chunks, _ = step(s)
    assert plan(chunks) == [("a", [3], 0, True)] and len(s.waiting) == 1


def test_followers_of_a_prompt_being_prefilled_take_its_keys_and_logits():
    s = scheduler(max_num_batched_tokens=4)
    for rid in "abc":
        s.add(seq(rid, [3, 4, 5, 6]))
    chunks = s.schedule(weight_version=0)
    # one prefill for three: the followers join past the spent budget and cost no tokens
    assert plan(chunks) == [("a", [3, 4, 5, 6], 0, True)]
    assert [q.request_id for q in samplers(chunks)] == ["a", "b", "c"]  # a's logits row, once per sampler
    s.apply(chunks, [7, 8, 9], [-1.0] * 3)
    assert [q.output_ids for q in s.running] == [[7], [8], [9]]
    assert [q.num_computed for q in s.running] == [4, 4, 4] and s.stats["prefix_shared"] == 2
    chunks, _ = step(s)
    assert plan(chunks) == [("a", [7], 4, True), ("b", [8], 4, True), ("c", [9], 4, True)]


def test_without_prefix_sharing_each_request_prefills():
    s = scheduler(prefix_sharing=False)
    s.add(seq("a", [3, 4]))
    s.add(seq("b", [3, 4]))
    chunks, _ = step(s)
    assert plan(chunks) == [("a", [3, 4], 0, True), ("b", [3, 4], 0, True)]


def test_an_aborted_leader_hands_its_followers_on():
    s = scheduler(max_num_batched_tokens=4)
    for rid in "abc":
        s.add(seq(rid, [3, 4, 5, 6, 7, 8]))
    step(s)  # a prefills 4 of 6; b and c wait for it
    s.by_id["a"].aborted = True
    assert [q.request_id for q in s.reap_aborted()] == ["a"]
    chunks = s.schedule(weight_version=0)
    assert plan(chunks) == [("b", [3, 4, 5, 6], 0, False)]  # b starts over in its own slot
    assert s.by_id["c"].leader is s.by_id["b"] and s.stats["aborted"] == 1


def test_a_token_for_a_sequence_gone_since_its_step_was_launched_is_dropped():
    s = scheduler()
    s.add(seq("a", [3]))
    s.add(seq("b", [4]))
    chunks = s.schedule(weight_version=0)
    s.drop(s.by_id["a"])  # as a stop token read while the lookahead step ran
    s.apply(chunks, [5, 6], [-1.0, -1.0])
    assert [(q.request_id, q.output_ids) for q in s.running] == [("b", [6])]
    assert s.stats["tokens_generated"] == 1


def test_admission_stamps_the_weight_version():
    s = scheduler()
    s.add(seq("a", [3]))
    s.schedule(weight_version=7)
    assert s.by_id["a"].weight_version == 7
