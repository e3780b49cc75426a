"""The agent-loop manager when one of its own actors hangs (SIGSTOP: alive to Ray, silent).

Without a limit the manager would wait for the hung actor forever; with `part_timeout_s`
it treats it as dead, replaces it within the restart budget, and the rollout gives the
same bits as before. Slow: Ray, one tiny replica, two workers, balancers.
"""

import os
import signal

import pytest

from reprorl.protocol import Batch
from reprorl.rollout.request import SamplingParams

pytestmark = pytest.mark.slow


def _batch(step: int) -> Batch:
    msgs = [[{"role": "user", "content": q}] for q in ("1+2=", "3+4=")]
    return Batch(non_tensors={"uid": ["a", "a", "b", "b"], "repeat_index": [0, 1, 0, 1], "raw_prompt": msgs[:1] * 2
                              + msgs[1:] * 2}, meta={"step": step, "validate": False})


@pytest.fixture(scope="module")
def manager(tiny_policy, ray_local):
    from reprorl.agent_loop.manager import AgentLoopManager
    from reprorl.rollout.replica import ReplicaPool
    from reprorl.actors.supervision import Restarts

    pool = ReplicaPool(tiny_policy, 1, seed=7, full_determinism=True, max_num_seqs=8, max_num_batched_tokens=256,
                       restarts=Restarts(2), part_timeout_s=4.0)
    made = AgentLoopManager(pool, 2, tiny_policy, max_response_length=8, max_turns=1, part_timeout_s=4.0,
                            sampling_params=SamplingParams(temperature=1.0, max_tokens=8))
    yield made
    made.shutdown()
    pool.shutdown()


def _stop(actor) -> None:
    pid = __import__("ray").get(actor.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGSTOP)


def test_a_hung_balancer_then_a_hung_worker_are_replaced_and_the_rollout_keeps_its_bits(manager):
    expected = manager.generate_sequences(_batch(1))
    manager.restarts.pop_metrics()

    hung = manager.balancer
    _stop(hung)
    assert manager.generate_sequences(_batch(1)).equal(expected)
    assert manager.balancer is not hung and manager.balancer_id == 1
    assert manager.restarts.pop_metrics()["agent_loop/balancer_restarts"] == 1.0

    _stop(manager.workers[0])
    assert manager.generate_sequences(_batch(1)).equal(expected)
    assert sorted(manager.workers) == [1, 2]
    metrics = manager.restarts.pop_metrics()
    assert metrics["agent_loop/worker_restarts"] == 1.0 and metrics["rollout/replica_restarts"] == 0.0
