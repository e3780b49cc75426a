"""Sampling: seeds, greedy, filters, the returned log-prob, and batched == per-row."""

import math
import os

import pytest
import torch

from reprorl.errors import ConfigError
from reprorl.rollout.request import SamplingParams
from reprorl.rollout.sampling import (
    _keep_mask,
    draw_uniforms,
    make_generator,
    sample_batch,
    sample_next,
)

PROBS = torch.tensor([0.5, 0.3, 0.2])
LOGITS = PROBS.log()


def draw_many(logits, params, seed, n):
    g = make_generator(seed)
    return [sample_next(logits, params, g)[0] for _ in range(n)]


def first_uniform(seed):
    return torch.rand((), dtype=torch.float64, generator=make_generator(seed)).item()


def test_same_seed_same_tokens():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0)
    assert draw_many(logits, p, 7, 30) == draw_many(logits, p, 7, 30)


def test_different_seeds_differ():
    logits = torch.zeros(50)  # uniform over 50 tokens: 30 equal draws would be a broken RNG
    p = SamplingParams(temperature=1.0)
    assert draw_many(logits, p, 1, 30) != draw_many(logits, p, 2, 30)


def test_greedy_ignores_seed_and_is_argmax():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=0.0)
    expected = int(torch.argmax(logits))
    for seed in range(5):
        assert draw_many(logits, p, seed, 3) == [expected] * 3


def test_greedy_ties_pick_lowest_id():
    logits = torch.tensor([0.0, 2.0, 1.0, 2.0])
    assert sample_next(logits, SamplingParams(temperature=0), make_generator(0))[0] == 1


def test_top_k_1_equals_greedy():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(4))
    for seed in range(10):
        tok, _ = sample_next(logits, SamplingParams(temperature=1.3, top_k=1), make_generator(seed))
        assert tok == int(torch.argmax(logits))


def test_inverse_cdf_by_hand():
    # probs [0.5, 0.3, 0.2]: CDF [0.5, 0.8, 1.0]; the first uniform of the seed picks the slot.
    p = SamplingParams(temperature=1.0)
    for seed in range(20):
        u = first_uniform(seed)
        expected = 0 if u < 0.5 else (1 if u < 0.8 else 2)
        assert sample_next(LOGITS, p, make_generator(seed))[0] == expected


def test_keep_mask_by_hand():
    # Binary fractions, so the sums are exact. top_p keeps the smallest top set whose
    # mass reaches top_p.
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    assert _keep_mask(probs, -1, 0.5).tolist() == [True, False, False, False]
    assert _keep_mask(probs, -1, 0.6).tolist() == [True, True, False, False]
    assert _keep_mask(probs, -1, 0.75).tolist() == [True, True, False, False]
    assert _keep_mask(probs, -1, 0.76).tolist() == [True, True, True, False]
    assert _keep_mask(probs, 2, 1.0).tolist() == [True, True, False, False]
    # Ties rank by token id: top_k=3 keeps id 2, not id 3.
    assert _keep_mask(probs, 3, 1.0).tolist() == [True, True, True, False]
    # top-p applies to the top-k set renormalised: {0.5, 0.25} -> {2/3, 1/3}.
    assert _keep_mask(probs, 2, 0.66).tolist() == [True, False, False, False]
    assert _keep_mask(probs, 2, 0.67).tolist() == [True, True, False, False]


def test_top_p_samples_only_kept_tokens():
    p = SamplingParams(temperature=1.0, top_p=0.6)
    assert set(draw_many(LOGITS, p, 0, 200)) == {0, 1}


def test_filters_off_equal_unfiltered():
    # Sampling walks vocabulary order, so a no-op filter changes nothing.
    logits = torch.randn(40, generator=torch.Generator().manual_seed(5))
    base = draw_many(logits, SamplingParams(), 11, 50)
    assert draw_many(logits, SamplingParams(top_k=40), 11, 50) == base
    assert draw_many(logits, SamplingParams(top_k=1000), 11, 50) == base


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=1.0), [0.5, 0.3, 0.2]),
        # T=2: probs proportional to sqrt(p).
        (SamplingParams(temperature=2.0), [math.sqrt(x) for x in (0.5, 0.3, 0.2)]),
        (SamplingParams(temperature=1.0, top_k=2), [0.5, 0.3, 0.0]),
    ],
)
def test_empirical_distribution(params, expected):
    expected = torch.tensor(expected, dtype=torch.float64)
    expected /= expected.sum()
    tokens = torch.tensor(draw_many(LOGITS, params, 123, 2000))
    freq = torch.bincount(tokens, minlength=3).double() / 2000
    # Tolerance 0.04 is > 3.5 standard deviations of a frequency from 2,000 draws
    # (sqrt(0.25 / 2000) = 0.011); the seed is fixed, so the test is deterministic.
    assert (freq - expected).abs().max() < 0.04, freq


def test_log_prob_is_untruncated_log_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    for params in [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_k=2, top_p=0.5),
    ]:
        tok, lp = sample_next(logits, params, make_generator(0))
        assert lp == torch.log_softmax(logits / 0.7, dim=-1)[tok].item()
    # Greedy: temperature 1. By hand: log(e^2 / (e^2 + e + e^0.5 + e^-1)).
    tok, lp = sample_next(logits, SamplingParams(temperature=0), make_generator(0))
    z = math.exp(2) + math.exp(1) + math.exp(0.5) + math.exp(-1)
    assert tok == 0 and abs(lp - (2 - math.log(z))) < 1e-6  # float32 vs float64
    assert sample_next(logits, SamplingParams(logprobs=False), make_generator(0))[1] is None


def test_one_draw_per_token_whatever_the_params():
    logits = torch.randn(30)
    expected_state = make_generator(9)
    torch.rand((), dtype=torch.float64, generator=expected_state)
    for params in [SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_k=3, top_p=0.3)]:
        g = make_generator(9)
        sample_next(logits, params, g)
        assert torch.equal(g.get_state(), expected_state.get_state())


def test_block_draws_equal_one_draw_per_token():
    g_one, g_block = make_generator(5), make_generator(5)
    one_by_one = [torch.rand((), dtype=torch.float64, generator=g_one).item() for _ in range(40)]
    assert draw_uniforms(g_block, 16) + draw_uniforms(g_block, 24) == one_by_one


@pytest.mark.parametrize("V", [3, 128, 1000])
def test_batch_equals_per_row(V):
    _check_batch_equals_per_row(V)


def test_batch_equals_per_row_with_the_pinned_probabilities(monkeypatch):
    """Under full determinism the probabilities come from the pinned softmax, in float64."""
    from reprorl.kernels import pinned

    monkeypatch.setattr(pinned, "_pinned", True)
    _check_batch_equals_per_row(1000)


def _check_batch_equals_per_row(V):
    torch.manual_seed(V)
    B = 24
    logits = torch.randn(B, V) * 3
    logits[5, :] = 1.0  # all ties
    choices = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.9),
        SamplingParams(temperature=0.8, top_k=2, top_p=0.5),
        SamplingParams(temperature=1.0, top_p=0.05),
    ]
    params = [choices[i % len(choices)] for i in range(B)]
    seeds = [1000 + i for i in range(B)]
    for _ in range(5):  # several tokens: the generators advance in step
        gens_row = [make_generator(s) for s in seeds]
        uniforms = [draw_uniforms(make_generator(s), 1)[0] for s in seeds]
        tokens, log_probs = sample_batch(logits, params, uniforms)
        rows = [sample_next(logits[i], params[i], gens_row[i]) for i in range(B)]
        assert torch.equal(tokens, torch.tensor([t for t, _ in rows]))
        assert torch.equal(log_probs, torch.tensor([lp for _, lp in rows], dtype=torch.float32))
        seeds = [s + 7 for s in seeds]
    # A row's result does not depend on the rows around it.
    sub = [3, 9, 17]
    uniforms = [draw_uniforms(make_generator(s), 1)[0] for s in seeds]
    t_sub, lp_sub = sample_batch(logits[sub], [params[i] for i in sub], [uniforms[i] for i in sub])
    t_all, lp_all = sample_batch(logits, params, uniforms)
    assert torch.equal(t_sub, t_all[sub]) and torch.equal(lp_sub, lp_all[sub])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"SamplingParams.{field}="):
        SamplingParams(**kwargs)


def test_stop_token_ids_become_a_tuple():
    assert SamplingParams(stop_token_ids=[5, 6]).stop_token_ids == (5, 6)


# ---- the GPU path, run here on CPU tensors (Triton under its interpreter) -----------------

from reprorl.kernels import TorchKernels  # noqa: E402
from reprorl.kernels.gpu import softmax as tl_softmax  # noqa: E402
from reprorl.kernels.gpu.sampling import sample_rows  # noqa: E402
from reprorl.rollout.sampling import any_filter, join_tokens_and_log_probs, pack_step_params, sample_on_device  # noqa: E402

# These hand the Triton kernels CPU tensors, which only its interpreter takes (conftest sets
# it where there is no CUDA, as in CI). On a GPU machine they skip; the kernels' bits on the
# device are checked there by test_engine_gpu.py (engine log-probs equal the trainer's).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (set without CUDA)")


def _torch_cumsum(x):
    return x.cumsum(-1)


def _on_device(logits, params, uniforms, cumsum=_torch_cumsum):
    packed = pack_step_params(params, uniforms, logits.shape[1])
    return sample_on_device(logits, packed, any_filter(params), TorchKernels.softmax, cumsum, sample_rows)


@interpreted
def test_device_sampler_by_hand():
    # probs 0.1, 0.2, 0.3, 0.4: the CDF 0.1, 0.3, 0.6, 1.0; u picks the first bin above u.
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().repeat(5, 1)
    params = [SamplingParams()] * 4 + [SamplingParams(temperature=0)]
    tokens, log_probs = _on_device(logits, params, [0.05, 0.25, 0.5, 0.99, 0.0])
    assert tokens.tolist() == [0, 1, 2, 3, 3]
    assert torch.equal(log_probs, tl_softmax.log_softmax(logits).gather(1, tokens[:, None])[:, 0])
    # top-k 2 keeps tokens 3 and 2 (mass 0.7): u = 0.5 -> 0.35 of it, past token 2's 0.3.
    tokens, _ = _on_device(logits[:2], [SamplingParams(top_k=2), SamplingParams(top_p=0.5)], [0.5, 0.1])
    assert tokens.tolist() == [3, 2]  # top-p 0.5: tokens 3 and 2; u = 0.1 of 0.7 falls in token 2


@interpreted
def test_device_sampler_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    B, V = 24, 1000
    logits = torch.randn(B, V) * 3
    choices = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(temperature=0.6, top_k=5),
               SamplingParams(temperature=1.2, top_p=0.9), SamplingParams(temperature=0.8, top_k=2, top_p=0.5)]
    params = [choices[i % len(choices)] for i in range(B)]
    uniforms = [draw_uniforms(make_generator(s), 1)[0] for s in range(B)]
    t_all, lp_all = _on_device(logits, params, uniforms)
    for sub in ([3], [9, 17], list(range(0, B, 3))):
        t, lp = _on_device(logits[sub], [params[i] for i in sub], [uniforms[i] for i in sub])
        assert torch.equal(t, t_all[sub]) and torch.equal(lp, lp_all[sub])
    # Greedy rows are the argmax; the host path gives the same tokens here (no CDF boundary is near).
    tokens, _ = sample_batch(logits, params, uniforms)
    assert torch.equal(t_all, tokens)


@interpreted
def test_device_sampler_maps_a_grid_of_uniforms_onto_the_distribution_exactly():
    """The fused sampler's distribution, exactly rather than by sampling: the uniforms
    (i + 1/2) / 400 fall in each token's CDF bin as often as 400 times its probability
    (no grid point lies on a bin's edge). What the draws are is the host's
    (`test_empirical_distribution` samples them), and 400 programs under the interpreter
    take seconds where 4000 random draws took most of a minute."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 400
    tokens, _ = _on_device(probs.log().repeat(n, 1), [SamplingParams()] * n, [(i + 0.5) / n for i in range(n)])
    assert torch.bincount(tokens, minlength=4).tolist() == [200, 120, 60, 20]
    assert tokens.tolist() == sorted(tokens.tolist())  # the inverse CDF is monotone in u


@interpreted
def test_triton_row_cumsum_matches_torch_and_is_row_invariant():
    from reprorl.kernels.gpu.sampling import BLOCK, row_cumsum

    g = torch.Generator().manual_seed(1)
    x = torch.rand(5, 2 * BLOCK + 37, generator=g)
    got = row_cumsum(x)
    # float32 sums of ~4000 terms in another order: within 1e-6 of their size, relative
    torch.testing.assert_close(got, x.double().cumsum(-1).float(), rtol=1e-5, atol=0)
    assert torch.equal(row_cumsum(x[2:3]), got[2:3])
    assert bool((got[:, 1:] >= got[:, :-1]).all()) and torch.equal(got[:, -1], got.max(-1).values)
    tokens, _ = _on_device(x.log(), [SamplingParams(top_p=0.9)] * 5, [0.3] * 5, cumsum=row_cumsum)
    ref, _ = _on_device(x.log(), [SamplingParams(top_p=0.9)] * 5, [0.3] * 5)
    assert torch.equal(tokens, ref)  # no CDF boundary within the sums' rounding here


def test_one_copy_back_keeps_the_bits():
    tokens = torch.tensor([0, 5, 151935])
    log_probs = torch.tensor([-0.0, -1.2345678, -30.5])
    t, lp = join_tokens_and_log_probs(tokens, log_probs)
    assert t == tokens.tolist() and torch.equal(torch.tensor(lp, dtype=torch.float32), log_probs)


def _margin_to_boundary(logits, params, uniforms):
    """Per row: the target's float64 distance to the nearest CDF entry over the total (the
    float32 and float64 paths pick the same token while it is well above their rounding)."""
    out = []
    for row, p, u in zip(logits.double(), params, uniforms):
        if p.greedy:
            out.append(1.0)
            continue
        cdf = torch.softmax(row / p.temperature, -1).cumsum(-1)
        out.append(float((cdf - u * cdf[-1]).abs().min() / cdf[-1]))
    return out


@interpreted
@pytest.mark.parametrize("vocab", [7, 1000, 2 * 4096 + 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_sampler_is_the_host_rule_with_the_triton_log_softmax(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    B = 6
    logits = (torch.randn(B, vocab, generator=g) * 3).to(dtype)
    params = [SamplingParams(temperature=t) for t in (0, 1.0, 0.7, 1.3, 0, 1.0)]
    uniforms = [draw_uniforms(make_generator(s), 1)[0] for s in range(B)]
    assert min(_margin_to_boundary(logits, params, uniforms)) > 1e-5  # the premise of comparing tokens
    tokens, log_probs, log_z = sample_rows(logits, pack_step_params(params, uniforms, vocab))
    ref_tokens, ref_log_probs = sample_batch(logits, params, uniforms, tl_softmax.log_softmax)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(log_probs, ref_log_probs)  # the Triton log-softmax's bits, same division by T
    temps = torch.tensor([p.temperature or 1.0 for p in params])
    scaled = logits.float() / temps[:, None]
    assert torch.equal(scaled - log_z[:, None], tl_softmax.log_softmax(scaled))  # its normaliser, for any token
    # a row alone is the same bits
    for i in (1, 4):
        alone = sample_rows(logits[i : i + 1], pack_step_params(params[i : i + 1], uniforms[i : i + 1], vocab))
        assert all(torch.equal(a, b[i : i + 1]) for a, b in zip(alone, (tokens, log_probs, log_z)))


@interpreted
def test_fused_sampler_edges():
    # A target that rounds up to the total takes the last token with mass, as the host rule.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0] + [float("-inf")] * 4])
    params, uniforms = [SamplingParams()], [1 - 2**-40]
    tokens, log_probs, _ = sample_rows(logits, pack_step_params(params, uniforms, 8))
    assert tokens.tolist() == [3] == sample_batch(logits, params, uniforms)[0].tolist()
    assert torch.equal(log_probs, torch.tensor([-2 * math.log(2)], dtype=torch.float32))
    # Greedy takes the lowest id of tied maxima, across blocks and lanes.
    logits = torch.zeros(1, 2 * 4096 + 10)
    logits[0, [5000, 4096 + 17, 17]] = 2.0  # 17 and 4096 + 17: one lane, two blocks
    tokens, _, _ = sample_rows(logits, pack_step_params([SamplingParams(temperature=0)], [0.5], 8202))
    assert tokens.tolist() == [17]
    with pytest.raises(ValueError, match=r"sample_rows: expected logits \[B, V\] and packed \[4, B\] float64"):
        sample_rows(logits, pack_step_params([SamplingParams()] * 2, [0.5, 0.5], 8202))
