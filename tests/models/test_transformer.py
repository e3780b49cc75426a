"""The two forward paths: forward_packed invariance (a sequence alone vs packed with random
others), prefill chunking, forward vs forward_packed agreement, heads, and cache errors."""

import dataclasses
import random

import pytest
import torch

from kernel_modes import on_kernels
from padded_layers import hidden_states_moving_in_each_layer
from reprorl.models.arch import ModelArgs
from reprorl.models.tiny import TINY_FAMILIES, init_weights
from reprorl.models.kv_cache import KVCache
from reprorl.models.transformer import CausalLM, SequenceClassifier, ValueModel

SHAPE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
FAMILY_ARGS = {
    "qwen2": ModelArgs(model_type="qwen2", qkv_bias=True, **SHAPE),
    "qwen3": ModelArgs(model_type="qwen3", qk_norm=True, **SHAPE),
    "llama": ModelArgs(
        model_type="llama", qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True, **SHAPE
    ),
    "olmo2": ModelArgs(model_type="olmo2", qk_norm_whole=True, post_norm=True, **SHAPE),
    "phi3": ModelArgs(model_type="phi3", fused_projections=True, partial_rotary_factor=0.75, **SHAPE),
    # the tiny families' switches: a sliding layer (window 5, its own RoPE base) and a global
    # one, queries scaled by 12^-1/2; and a window of 3 on both layers
    "gemma3_text": ModelArgs(model_type="gemma3_text", **{**TINY_FAMILIES["gemma3_text"], "sliding_window": 5,
                                                          "query_pre_attn_scalar": 12}, tie_word_embeddings=True,
                             **SHAPE),
    "mistral-window": ModelArgs(model_type="mistral", **{**TINY_FAMILIES["mistral"], "sliding_window": 3}, **SHAPE),
}
WINDOWED = ["gemma3_text", "mistral-window"]


def build(cls=CausalLM, family="qwen2", seed=0):
    model = cls(FAMILY_ARGS[family])
    init_weights(model, seed, std=0.15)  # logits O(1), so tolerances below are tight
    return model.eval()


def prefill(model, prompts, cache, slots=None):
    """Pack whole prompts (or decode tokens) into one forward_packed call -> hidden [sum(len), H]."""
    return model.forward_packed(torch.cat(prompts), [len(p) for p in prompts], cache, slots)


def random_prompts(n, rng, vocab=96, max_len=20):
    return [torch.tensor([rng.randrange(3, vocab) for _ in range(rng.randint(1, max_len))]) for _ in range(n)]


def new_cache(model, capacity=64, num_slots=1):
    return KVCache.for_model(model.args, capacity, num_slots)


def check_companions(family, runs):
    """Prefill and then 3 decode steps of one sequence: alone (1 thread), and packed among
    random others at a random slot, for each (threads, companions) in runs. Hidden states
    and logits are compared bitwise."""
    model = build(family=family)
    rng = random.Random(family)
    prompt = torch.tensor([5, 17, 33, 8, 91, 40, 2])
    steps = [torch.tensor([7]), torch.tensor([64]), torch.tensor([12])]
    with on_kernels(model), torch.inference_mode():
        torch.set_num_threads(1)
        cache = new_cache(model)
        alone = [prefill(model, [prompt], cache)]
        alone += [prefill(model, [tok], cache) for tok in steps]
        for threads, companions in runs:
            torch.set_num_threads(threads)
            others = random_prompts(companions, rng)
            slot = rng.randrange(companions + 1)
            # Cache slots in a random order: some steps read the store as a view, some gather.
            cache = new_cache(model, num_slots=2 * companions + 2)
            slots = rng.sample(range(2 * companions + 2), companions + 1)
            order = others[:slot] + [prompt] + others[slot:]
            hidden = prefill(model, order, cache, slots)
            start = sum(len(p) for p in order[:slot])
            assert torch.equal(hidden[start : start + len(prompt)], alone[0]), (threads, companions, slot)
            for step, tok in enumerate(steps):
                # decode: one token per sequence; the companions draw theirs at random
                tokens = [torch.tensor([rng.randrange(3, 96)]) for _ in order]
                tokens[slot] = tok
                hidden = prefill(model, tokens, cache, slots)
                assert torch.equal(hidden[slot : slot + 1], alone[step + 1]), (threads, companions, step)
                assert torch.equal(model.logits(hidden)[slot], model.logits(alone[step + 1])[0])


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "olmo2", "phi3", *WINDOWED])
def test_packed_sequence_is_invariant_to_its_companions(family):
    check_companions(family, [(1, 1), (1, 9), (1, 30), (1, 63)])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_packed_sequence_is_invariant_to_threads(family):
    """The same with 2 and 3 threads (slow only on a loaded machine: OpenMP waits)."""
    check_companions(family, [(2, 1), (2, 9), (3, 30), (2, 63)])


def test_prefill_chunking_is_invisible():
    model = build()
    prompt = torch.tensor(random_prompts(1, random.Random(1), max_len=40)[0].tolist() + [9] * 30)
    with on_kernels(model), torch.inference_mode():
        cache = new_cache(model, 128)
        whole = prefill(model, [prompt], cache)
        for chunks in ([1] * 8 + [len(prompt) - 8], [5, 17, len(prompt) - 22]):
            cache, start, pieces = new_cache(model, 128), 0, []
            for n in chunks:
                pieces.append(prefill(model, [prompt[start : start + n]], cache))
                start += n
            assert torch.equal(torch.cat(pieces), whole)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "olmo2", "phi3", *WINDOWED])
def test_forward_agrees_with_forward_packed(family):
    """Logits of `forward` on a left-padded batch vs prefill + decode through the cache:
    bitwise equal in batch-invariant mode, within float32 rounding in plain mode."""
    model = build(family=family, seed=2)
    rng = random.Random(2)
    seqs = random_prompts(3, rng, max_len=16)
    width = max(len(s) for s in seqs)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = s
        mask[i, width - len(s) :] = 1
    for invariant in (False, True):
        with on_kernels(model, invariant), torch.inference_mode():
            full = model(ids, mask)
            for i, s in enumerate(seqs):
                cache = new_cache(model)
                cut = (len(s) + 1) // 2  # prefill the first half, decode the rest
                hidden = [prefill(model, [s[:cut]], cache)]
                hidden += [prefill(model, [s[t : t + 1]], cache) for t in range(cut, len(s))]
                packed = model.logits(torch.cat(hidden))
                if invariant:
                    assert torch.equal(packed, full[i, width - len(s) :])
                else:
                    torch.testing.assert_close(packed, full[i, width - len(s) :], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 130])
def test_a_windowed_token_is_the_same_bits_on_every_path(window):
    """A 300-token sequence through layers with a window (1, or 130 so whole key blocks of
    128 fall outside it and others straddle its edge), on the invariant kernels: prefilled
    whole, in chunks, decoded token by token, and in the trainer's padded batch beside
    others, every token's hidden state is the same bits."""
    args = dataclasses.replace(FAMILY_ARGS["gemma3_text"], sliding_window=window)
    model = CausalLM(args)
    init_weights(model, 7, std=0.15)
    rng = random.Random(window)
    seq = torch.tensor([rng.randrange(3, 96) for _ in range(300)])
    with on_kernels(model.eval()), torch.inference_mode():
        whole = prefill(model, [seq], new_cache(model, 384))
        cache, start, pieces = new_cache(model, 384), 0, []
        for n in (1, 126, 5, 130, 38):  # chunks crossing the key blocks' edges
            pieces.append(prefill(model, [seq[start : start + n]], cache))
            start += n
        assert torch.equal(torch.cat(pieces), whole)
        cache = new_cache(model, 384)
        decoded = [prefill(model, [seq[:250]], cache)] + [prefill(model, [seq[t : t + 1]], cache)
                                                          for t in range(250, 300)]
        assert torch.equal(torch.cat(decoded), whole)
        ids = torch.randint(3, 96, (3, 310), generator=torch.Generator().manual_seed(window))
        mask = torch.ones_like(ids)
        ids[1, :10], mask[1, :10] = 0, 0
        ids[1, 10:] = seq  # left padded, between two others
        assert torch.equal(model.hidden_states(ids, mask)[1, 10:], whole)


def test_forward_is_padding_invariant():
    """In batch-invariant mode a sequence's logits do not depend on its padding or batch."""
    model = build(seed=3)
    seq = torch.tensor([4, 8, 15, 16, 23, 42])
    g = torch.Generator().manual_seed(3)
    with on_kernels(model), torch.no_grad():
        alone = model(seq[None])[0]
        ids = torch.randint(3, 96, (5, 11), generator=g)
        mask = torch.ones(5, 11, dtype=torch.long)
        ids[2], mask[2] = 0, 0
        ids[2, 5:] = seq  # left padding
        mask[2, 5:] = 1
        ids[4, :6], ids[4, 6:], mask[4, 6:] = seq, 0, 0  # right padding
        out = model(ids, mask)
        assert torch.equal(out[2, 5:], alone)
        assert torch.equal(out[4, :6], alone)


def test_layers_on_real_tokens_first_give_every_positions_bits():
    """In batch-invariant mode the layers run on each row's real tokens moved to its front
    (`Padding.front`): the same bits at every position, padding included, as running them in
    the caller's layout with attention moving each row in every layer."""
    model = build(seed=5)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 96, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[1, 7:] = 0  # right padding
    mask[2, :2], mask[2, 8:] = 0, 0  # both
    with on_kernels(model), torch.no_grad():
        assert torch.equal(model.hidden_states(ids, mask), hidden_states_moving_in_each_layer(model, ids, mask))


def test_forward_is_differentiable_in_both_modes():
    model = build(seed=4)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    grads = []
    for invariant in (False, True):
        model.zero_grad()
        with on_kernels(model, invariant) as k:
            logp = k.log_softmax(model(ids, mask))
            (logp[mask.bool()].gather(-1, ids[mask.bool()][:, None])).sum().backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)  # backward sums in another order


def test_reward_head_reads_the_last_real_token():
    model = build(SequenceClassifier, seed=5)
    seq = torch.tensor([[7, 3, 9, 30, 31]])
    with on_kernels(model), torch.inference_mode():
        score = model(seq)  # [1, 1]
        padded = model(
            torch.tensor([[0, 0, 7, 3, 9, 30, 31], [7, 3, 9, 30, 31, 0, 0]]),
            torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]]),
        )
        hidden = model.forward_packed(seq[0], [5], new_cache(model))
        assert torch.equal(model.scores(hidden[-1:]), score)
    assert score.shape == (1, 1)
    assert torch.equal(padded, score.expand(2, 1))


def test_value_head_gives_one_value_per_token():
    model = build(ValueModel, seed=6)
    ids = torch.tensor([[7, 3, 9, 30, 31]])
    with torch.no_grad():
        values = model(ids)
        expected = model.hidden_states(ids) @ model.score.weight[0] + model.score.bias[0]
    assert values.shape == (1, 5)
    torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-6)


def test_bfloat16_plain_path_runs_close_to_float32():
    model = build(seed=7)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.inference_mode():
        reference = model(ids)
        model_bf16 = model.to(torch.bfloat16)
        out = model_bf16(ids)
        cache = KVCache.for_model(model.args, 16, dtype=torch.bfloat16)
        packed = model_bf16.logits(model_bf16.forward_packed(ids[0], [6], cache))
    assert out.dtype == torch.bfloat16
    # bfloat16 keeps 8 bits of mantissa (relative error 4e-3 per op, over ~20 ops): 1e-1 of O(1) logits.
    torch.testing.assert_close(out.float(), reference, rtol=0, atol=1e-1)
    torch.testing.assert_close(packed.float(), reference[0], rtol=0, atol=1e-1)


def test_padded_forward_checks_positions_against_the_rope_tables():
    """Wider than the tables (512 positions) is fine while padding keeps every position inside
    them (the host bound T - 1 is past them, so the check reads the positions), and an error
    naming the position when a real token is past them."""
    model = build()
    ids = torch.randint(3, model.args.vocab_size, (1, 520), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :10] = 0  # left padding: positions 0..509
    with torch.inference_mode():
        assert model(ids, mask).shape == (1, 520, model.args.vocab_size)
        with pytest.raises(ValueError, match="position 519 is past max_position_embeddings=512"):
            model(ids)


def test_forward_packed_of_no_sequences():
    """An empty pack is a no-op, not an indexing error (it once built float index tensors)."""
    model = build()
    cache = new_cache(model, num_slots=2)
    hidden = model.forward_packed(torch.zeros(0, dtype=torch.long), [], cache, [])
    assert hidden.shape == (0, model.args.hidden_size) and cache.lengths == [0, 0]


def test_cache_and_packing_errors():
    model = build()
    cache = new_cache(model, capacity=4)
    with pytest.raises(ValueError, match="slot 0 of capacity 4 holds 0 tokens; cannot add 5"):
        model.forward_packed(torch.arange(5), [5], cache)
    with pytest.raises(ValueError, match="seq_lens .* summing to 4 over 1 sequences, 1 slots"):
        model.forward_packed(torch.arange(5), [4], cache)
    with pytest.raises(ValueError, match=r"slots \[0, 0\] must be distinct, in \[0, 1\)"):
        model.forward_packed(torch.arange(5), [2, 3], cache, [0, 0])
    with pytest.raises(ValueError, match=r"KVCache of 2 layers x 2 kv heads x head_dim 16, torch.bfloat16, does not fit"):
        model.forward_packed(torch.arange(2), [2], KVCache.for_model(model.args, 8, dtype=torch.bfloat16))
    long = new_cache(model, capacity=600)
    long.lengths[0] = 511
    with pytest.raises(ValueError, match="position 512 is past max_position_embeddings=512"):
        model.forward_packed(torch.arange(2), [2], long)
    assert cache.lengths == [0] and long.lengths == [511]  # nothing was appended by the failed calls
    with torch.inference_mode():
        model.forward_packed(torch.arange(3), [3], cache)
    assert (cache.lengths, cache.capacity) == ([3], 4)
    cache.grow(300)  # keeps what is cached
    with torch.inference_mode():
        grown = model.forward_packed(torch.tensor([3]), [1], cache)
        fresh = new_cache(model, capacity=300)
        model.forward_packed(torch.arange(3), [3], fresh)
        assert torch.equal(grown, model.forward_packed(torch.tensor([3]), [1], fresh))
