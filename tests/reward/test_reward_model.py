"""The reward model: agreement with transformers, batch invariance, replicas on Ray."""

import random

import pytest
import torch

from reprorl.models.tiny import make_tiny

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +-=?"


def _pairs(num, seed, max_len=24):
    rng = random.Random(seed)

    def text():
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, max_len)))

    return [[{"role": "user", "content": text()}] for _ in range(num)], [text() for _ in range(num)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for this file: two threads spin against the other processes on a
    busy 2-core machine and run 5-10x slower. The thread test sets 1 and 2 explicitly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return str(make_tiny(tmp_path_factory.mktemp("rm") / "tiny-rm", kind="reward", seed=3))


@pytest.fixture(scope="module")
def scorer(rm_path):
    from reprorl.reward.reward_model import RewardModelScorer

    return RewardModelScorer(rm_path, max_num_seqs=64, batch_invariant=True)


def test_input_is_the_rm_chat_template(scorer):
    ids = scorer.input_ids([{"role": "user", "content": "1+2="}], "3")
    text = scorer.tokenizer.decode(ids, skip_special_tokens=False)
    assert text == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n"


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_scores_match_transformers(rm_path, batch_invariant):
    from transformers import AutoModelForSequenceClassification

    from reprorl.reward.reward_model import RewardModelScorer

    scorer = RewardModelScorer(rm_path, max_num_seqs=8, batch_invariant=batch_invariant)
    hf = AutoModelForSequenceClassification.from_pretrained(rm_path, torch_dtype=torch.float32).eval()
    prompts, responses = _pairs(12, seed=0)
    ours = scorer.score(prompts, responses)  # [12], in two forwards (max_num_seqs 8)
    assert ours.shape == (12,) and ours.dtype == torch.float32
    with torch.no_grad():
        # One sequence per call, no padding: transformers' score at the last token.
        theirs = torch.stack([
            hf(torch.tensor([scorer.input_ids(p, r)])).logits[0, 0] for p, r in zip(prompts, responses)
        ])
    # float32, 2 layers of width 128, scores of order 0.1: the two sides differ only in
    # summation order (padded matmuls, pairwise sums); measured about 1.5e-7.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert ours.std() > 0  # the scores are not all one value: the check compares something


def test_score_of_a_sample_does_not_depend_on_its_batch(scorer):
    prompts, responses = _pairs(40, seed=1)
    target_p, target_r = [{"role": "user", "content": "What is 12+7?"}], "19"
    alone = scorer.score([target_p], [target_r])  # [1]
    rng = random.Random(2)
    for size in range(2, 17):
        others = rng.sample(range(40), size - 1)
        pos = rng.randrange(size)
        ps = [prompts[i] for i in others]
        rs = [responses[i] for i in others]
        ps.insert(pos, target_p)
        rs.insert(pos, target_r)
        batch_scores = scorer.score(ps, rs)
        assert torch.equal(batch_scores[pos : pos + 1], alone), f"batch of {size}, position {pos}"
        # ... and every other row equals its own score alone.
        if size == 16:
            singles = torch.cat([scorer.score([p], [r]) for p, r in zip(ps, rs)])
            assert torch.equal(batch_scores, singles)


def test_forward_chunks():
    import doctest

    from reprorl.reward import reward_model
    from reprorl.reward.reward_model import forward_chunks

    results = doctest.testmod(reward_model)
    assert results.attempted > 0 and results.failed == 0
    assert forward_chunks([], 4, 100) == []
    assert forward_chunks([5] * 5, 2, 1000) == [(0, 2), (2, 4), (4, 5)]
    assert forward_chunks([60, 40, 1], 8, 100) == [(0, 2), (2, 3)]  # the budget is inclusive
    assert forward_chunks([500, 500], 8, 100) == [(0, 1), (1, 2)]  # each over budget: alone


def test_chunking_and_threads_do_not_change_scores(rm_path, scorer):
    from reprorl.reward.reward_model import RewardModelScorer

    prompts, responses = _pairs(12, seed=4)
    reference = scorer.score(prompts, responses)
    one_at_a_time = RewardModelScorer(rm_path, max_num_seqs=1, batch_invariant=True)
    assert torch.equal(one_at_a_time.score(prompts, responses), reference)
    by_tokens = RewardModelScorer(rm_path, max_num_seqs=64, max_num_batched_tokens=100, batch_invariant=True)
    assert torch.equal(by_tokens.score(prompts, responses), reference)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(scorer.score(prompts, responses), reference), f"{n} threads"
    finally:
        torch.set_num_threads(threads)


def test_big_cache_is_not_kept_between_calls(rm_path, scorer, monkeypatch):
    """Over KEEP_CACHE_BYTES the scorer frees its KV cache after each call; the scores stay
    the same bits, and a small cache is kept (the default, for the tiny model)."""
    from reprorl.reward import reward_model

    prompts, responses = _pairs(6, seed=5)
    reference = scorer.score(prompts, responses)
    assert scorer._cache is not None and 0 < scorer._cache.nbytes <= reward_model.KEEP_CACHE_BYTES
    fresh = reward_model.RewardModelScorer(rm_path, max_num_seqs=64, batch_invariant=True)
    monkeypatch.setattr(reward_model, "KEEP_CACHE_BYTES", 0)
    for _ in range(2):
        assert torch.equal(fresh.score(prompts, responses), reference)
        assert fresh._cache is None


def test_score_errors(scorer):
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        scorer.score([[], []], ["a"])
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        scorer.score_ids([[1, 2], []])
    with pytest.raises(ValueError, match="sequence 65 has 2049 tokens, over the reward model's max_position_embeddings=2048"):
        scorer.score_ids([[5]] * 65 + [[5] * 2049])  # index in the batch, not in its forward chunk
    assert scorer.score([], []).shape == (0,)


# ---- Ray replicas ---------------------------------------------------------------------


@pytest.mark.slow  # three replica actors start (torch + model each): 15-25 s on 2 shared cores
def test_replicas_give_the_same_scores(ray_local, rm_path, monkeypatch):
    from reprorl.kernels import pinned
    from reprorl.reward.reward_model import RewardModelPool, RewardModelScorer

    prompts, responses = _pairs(13, seed=5)  # 13: chunks of 7 and 6 over two replicas
    # The replicas run full determinism, which pins the host's CPU math (the RoPE tables
    # among it): the reference here is built pinned too, whatever earlier tests left.
    monkeypatch.setattr(pinned, "_pinned", True)
    reference = RewardModelScorer(rm_path, max_num_seqs=64, batch_invariant=True).score(prompts, responses)
    results = []
    for num_replicas in (1, 2):
        pool = RewardModelPool(rm_path, num_replicas, seed=0, full_determinism=True, max_num_seqs=4)
        try:
            results.append(pool.score(prompts, responses))
        finally:
            pool.shutdown()
    assert torch.equal(results[0], reference)
    assert torch.equal(results[1], reference)


@pytest.mark.slow  # replica actors start, one hangs for the pool's limit: about 30 s
def test_a_reward_replica_that_hangs_in_score_is_replaced_and_the_scores_kept(ray_local, rm_path, scorer,
                                                                             monkeypatch):
    """Replica 1 SIGSTOPs itself at its first score call: past `part_timeout_s` it is killed
    and replaced, its chunk scored again, and the scores are the same bits."""
    from reprorl.reward.reward_model import RewardModelPool
    from reprorl.actors.supervision import HANG_ENV, Restarts

    monkeypatch.setenv(HANG_ENV, "reward replica 1@score#1")
    prompts, responses = _pairs(13, seed=5)
    restarts = Restarts(max_restarts=1)
    pool = RewardModelPool(rm_path, 2, seed=0, full_determinism=True, max_num_seqs=4, restarts=restarts,
                           part_timeout_s=8.0)
    try:
        scores = pool.score(prompts, responses)
        assert sorted(pool.replicas) == [0, 2]  # replica 2 replaced the hung replica 1
    finally:
        pool.shutdown()
    assert torch.equal(scores, scorer.score(prompts, responses))


def test_replica_without_the_determinism_env_fails_at_start(ray_local, rm_path):
    from reprorl.determinism import determinism_env
    from reprorl.reward.reward_model import RewardReplica

    ray = ray_local
    actor = ray.remote(RewardReplica).options(num_cpus=0.1).remote(
        7, rm_path, {"max_num_seqs": 4}, determinism_env(0, full_determinism=True)
    )
    with pytest.raises(ray.exceptions.RayActorError) as err:
        ray.get(actor.ready.remote())
    message = str(err.value)
    assert "reward replica 7" in message
    assert "REPRORL_FULL_DETERMINISM is missing" in message


def test_reward_loop_with_the_reward_model(scorer, char_tokenizer):
    """The loop hands the RM each row's raw prompt and decoded response, in sample order."""
    from reprorl.data.rewards import compute_score
    from reprorl.protocol import Batch
    from reprorl.reward.loop import RewardLoop

    texts = ["19<|im_end|>", "20<|im_end|>", "19"]
    responses = torch.full((3, 8), char_tokenizer.pad_token_id)
    for i, text in enumerate(texts):
        ids = char_tokenizer(text, add_special_tokens=False)["input_ids"]
        responses[i, : len(ids)] = torch.tensor(ids)
    prompts = [[{"role": "user", "content": "What is 12+7?"}]] * 3
    batch = Batch({"responses": responses, "response_mask": (responses != char_tokenizer.pad_token_id).long()},
                  {"raw_prompt": prompts, "data_source": ["reprorl/arithmetic"] * 3, "ground_truth": ["19"] * 3})
    scores, _, metrics, *_ = RewardLoop(compute_score, scorer, rule_weight=1.0, model_weight=0.5).compute(batch, char_tokenizer)
    model = scorer.score(prompts, ["19", "20", "19"])
    assert torch.equal(model[0], model[2])  # same (prompt, response), different rows
    assert torch.equal(scores, torch.tensor([1.0, 0.0, 1.0]) + 0.5 * model)
    assert metrics["reward/model_mean"] == pytest.approx(model.double().mean().item(), abs=1e-7)


def test_the_two_scorer_backends_do_not_import_each_other():
    """vllm_reward imported reward_model (for ChatScorer) while reward_model imports vllm_reward:
    the base class lives in reward/chat.py now."""
    import subprocess
    import sys

    code = ("import sys, reprorl.reward.vllm_reward; "
            "assert 'reprorl.reward.reward_model' not in sys.modules, 'vllm_reward imports reward_model'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow  # one replica actor starts (torch + model): 10-20 s on 2 shared cores
def test_the_pool_passes_its_device_and_dtype_to_its_replicas(ray_local, rm_path):
    """Started with wait=False (as the trainer starts its parts together), the replica runs
    on the pool's device in its dtype and scores as an in-process scorer in that dtype does."""
    from reprorl.reward.reward_model import RewardModelPool, RewardModelScorer

    prompts, responses = _pairs(6, seed=7)
    pool = RewardModelPool(rm_path, 1, seed=0, full_determinism=True, max_num_seqs=4, device="cpu",
                           dtype="bfloat16", wait=False)
    try:
        pool.wait_ready()
        pool.wait_ready()  # a second call returns at once
        info = pool.determinism_info()[0]
        scores = pool.score(prompts, responses)
    finally:
        pool.shutdown()
    assert (info["device"], info["dtype"]) == ("cpu", "bfloat16")
    local = RewardModelScorer(rm_path, max_num_seqs=4, batch_invariant=True, dtype=torch.bfloat16)
    assert torch.equal(scores, local.score(prompts, responses))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_reward_pool_on_the_gpu_scores_the_same_bits_every_call(rm_path):
    """Issue 14: the reward model on the GPU, on a Ray GPU share as the trainer places it.
    Its replica reports the GPU (the determinism report's `device`, `gpu`, `cuda`); a call
    repeated, and the same pairs in another order, give the same bits (batch invariance)."""
    import ray

    from reprorl.reward.reward_model import RewardModelPool

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", include_dashboard=False)
    prompts, responses = _pairs(13, seed=5)
    pool = RewardModelPool(rm_path, 1, seed=0, full_determinism=True, max_num_seqs=4, device="cuda",
                           dtype="bfloat16", num_gpus=0.25)
    try:
        info = pool.determinism_info()[0]
        first = pool.score(prompts, responses)
        again = pool.score(prompts, responses)
        backwards = pool.score(prompts[::-1], responses[::-1])
    finally:
        pool.shutdown()
        if started:
            ray.shutdown()
    assert info["device"].startswith("cuda") and info["dtype"] == "bfloat16" and "gpu" in info, info
    assert info["kernels"] == "triton" and info["batch_invariant"], info
    assert first.shape == (13,) and first.dtype == torch.float32 and first.device.type == "cpu"
    assert torch.equal(first, again)
    assert torch.equal(first, backwards.flip(0))
