"""Supervision: the run's restart budget, the kill-switch test hook, and replacing dead actors.

The actors here are stand-ins (no model), so the slow tests cost Ray's start and a few
light actors; replicas of real models die in tests/trainer/test_faults.py.
"""

import subprocess
import sys

import pytest

from reprorl.actors.supervision import (
    HANG_ENV,
    KILL_ENV,
    RESTART_METRICS,
    FaultError,
    KillSwitch,
    PartTimeoutError,
    Restarts,
    kill_switch_env,
)


def test_restarts_charge_up_to_the_limit_then_name_the_part():
    restarts = Restarts(2)
    restarts.watch("rollout replica")
    restarts.watch("agent-loop worker")
    assert restarts.pop_metrics() == {"agent_loop/worker_restarts": 0.0, "rollout/replica_restarts": 0.0}
    restarts.charge("rollout replica", 1, "update_weights")
    restarts.charge("agent-loop worker", 0, "a rollout")
    assert restarts.pop_metrics() == {"agent_loop/worker_restarts": 1.0, "rollout/replica_restarts": 1.0}
    assert restarts.pop_metrics() == {"agent_loop/worker_restarts": 0.0, "rollout/replica_restarts": 0.0}
    with pytest.raises(FaultError, match=r"^rollout replica 3 died \(noticed in score at .*\) and no replacement "
                                         r"is left: trainer.max_restarts=2 replacements allowed per run, 2 made$"):
        restarts.charge("rollout replica", 3, "score")
    assert restarts.total == 2


def test_no_restarts_allowed_stops_at_the_first_death():
    with pytest.raises(FaultError, match="reward replica 0 died .* trainer.max_restarts=0"):
        Restarts(0).charge("reward replica", 0, "score")
    with pytest.raises(ValueError, match="max_restarts=-1"):
        Restarts(-1)
    assert set(RESTART_METRICS) == {"rollout replica", "reward replica", "agent-loop worker", "load balancer"}


def test_kill_switch_reads_only_its_own_rules(monkeypatch):
    monkeypatch.setenv(KILL_ENV, "rollout replica 1@train/3/#2, agent-loop worker 0@train/4/#1,rollout replica 1@score#9")
    switch = KillSwitch.from_env("rollout replica 1")
    assert switch.rules == [("train/3/", 2), ("score", 9)]
    assert KillSwitch.from_env("rollout replica 10") is None
    switch.see("train/3/a/0")  # the first of two: no kill yet
    switch.see("train/4/a/0")  # another prefix: not counted
    assert switch.seen == [1, 0]
    assert kill_switch_env() == {KILL_ENV: "rollout replica 1@train/3/#2, agent-loop worker 0@train/4/#1,"
                                           "rollout replica 1@score#9"}
    monkeypatch.setenv(KILL_ENV, "rollout replica 1@train/3/")
    with pytest.raises(ValueError, match="expected '<part>@<prefix>#<n>'"):
        KillSwitch.from_env("rollout replica 1")
    monkeypatch.delenv(KILL_ENV)
    assert KillSwitch.from_env("rollout replica 1") is None and kill_switch_env() == {}


def test_hang_rules_sigstop_and_travel_to_the_actors(monkeypatch):
    import signal

    from reprorl.actors.supervision import time_limit

    monkeypatch.setenv(KILL_ENV, "rollout replica 1@train/3/#1")
    monkeypatch.setenv(HANG_ENV, "rollout replica 1@train/2/#1,rollout replica 0@train/2/#1")
    switch = KillSwitch.from_env("rollout replica 1")
    assert switch.rules == [("train/3/", 1), ("train/2/", 1)]
    assert switch.signals == [signal.SIGKILL, signal.SIGSTOP]
    assert kill_switch_env() == {KILL_ENV: "rollout replica 1@train/3/#1",
                                 HANG_ENV: "rollout replica 1@train/2/#1,rollout replica 0@train/2/#1"}
    assert time_limit(5.0) == 5.0 and time_limit(5.0, 999_999) == 5.0 and time_limit(5.0, 3_000_000) == 15.0


def test_kill_switch_sigkills_its_process_on_the_nth_request():
    code = ("from reprorl.actors.supervision import KillSwitch\n"
            "s = KillSwitch.from_env('reward replica 0')\n"
            "s.see('score'); print('alive after 1', flush=True); s.see('score'); print('alive after 2')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, KILL_ENV: "reward replica 0@score#2"})
    assert proc.returncode == -9, proc.stderr
    assert proc.stdout == "alive after 1\n"


# --- on Ray, with stand-in actors -----------------------------------------------------------


class _Part:
    """Stands in for a replica or worker: it answers its mode and can die on request."""

    def __init__(self, part_id, batch_invariant=True):
        self.part_id = part_id
        self.batch_invariant = batch_invariant

    def determinism_info(self):
        return {"backend": "fake", "batch_invariant": self.batch_invariant, "env": {}}

    def work(self, x):
        return (self.part_id, x * 2)

    def die(self):
        import os

        os._exit(1)

    def stop(self):
        """Hang: SIGSTOP its own process (alive to Ray, silent)."""
        import os
        import signal

        os.kill(os.getpid(), signal.SIGSTOP)


@pytest.mark.slow  # Ray's start and a few actors: 5-15 s here
def test_gather_and_replace_dead(ray_local, actor_dead):
    import itertools

    import ray

    from reprorl.actors.supervision import gather, replace_dead

    part = ray.remote(num_cpus=0)(_Part)
    actors = {i: part.remote(i) for i in range(3)}
    reference = ray.get(actors[0].determinism_info.remote())
    ray.wait([actors[1].die.remote()])
    results, failed = gather({i: a.work.remote(i) for i, a in actors.items()})
    assert results == {0: (0, 0), 2: (2, 4)} and list(failed) == [1]
    assert isinstance(failed[1], ray.exceptions.RayActorError)

    restarts, new_ids = Restarts(1), itertools.count(3)
    restarts.watch("rollout replica")
    brought_up = []
    replaced = replace_dead(actors, failed, "rollout replica", new_ids, start=part.remote, reference_info=reference,
                            restarts=restarts, noticed_in="work", bring_up=lambda a: brought_up.append(a) or "ok")
    assert replaced == {1: 3} and sorted(actors) == [0, 2, 3] and brought_up == [actors[3]]
    assert ray.get(actors[3].work.remote(5)) == (3, 10)
    assert restarts.pop_metrics() == {"rollout/replica_restarts": 1.0}

    # Past the budget: the error names the part, and the dead actor stays where it was.
    ray.wait([actors[0].die.remote()])
    with pytest.raises(FaultError, match="rollout replica 0 died .* trainer.max_restarts=1"):
        replace_dead(actors, [0], "rollout replica", new_ids, start=part.remote, reference_info=reference,
                     restarts=restarts, noticed_in="work")
    assert sorted(actors) == [0, 2, 3]

    # A hung part: no answer within the limit is a failure of its own, and its replacement
    # (the hung process killed) is charged and logged as a hang.
    actors[2].stop.remote()
    results, failed = gather({i: actors[i].work.remote(i) for i in (2, 3)}, timeout_s=2.0)
    assert results == {3: (3, 6)} and list(failed) == [2]
    assert isinstance(failed[2], PartTimeoutError) and str(failed[2]) == "no answer within 2 s"
    with pytest.raises(FaultError, match=r"^rollout replica 2 hung \(no answer within 2 s\) \(noticed in work at "):
        replace_dead(actors, failed, "rollout replica", new_ids, start=part.remote, reference_info=reference,
                     restarts=Restarts(0), noticed_in="work")
    hung = actors[2]
    assert replace_dead(actors, failed, "rollout replica", new_ids, start=part.remote, reference_info=reference,
                        restarts=Restarts(1), noticed_in="work") == {2: 6}
    assert actor_dead(hung, within_s=30.0)

    # A replacement in another determinism mode does not take over.
    wrong_mode = ray.remote(num_cpus=0)(_Part).options()
    with pytest.raises(FaultError, match=r"rollout replica 0 died and its replacement rollout replica 7 cannot take "
                                         r"over: RuntimeError: it runs in another determinism mode: batch_invariant "
                                         r"False \(the first had True\)"):
        replace_dead(actors, [0], "rollout replica", new_ids, start=lambda i: wrong_mode.remote(i, False),
                     reference_info=reference, restarts=Restarts(1), noticed_in="work")
    for a in actors.values():
        ray.kill(a)
