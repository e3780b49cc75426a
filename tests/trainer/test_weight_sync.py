"""Which weight path each replica gets (reprorl/trainer/weight_sync.py), on stand-ins for the
actor and the pool; the paths themselves run in tests/trainer/test_weight_sync_gpu.py (device)
and tests/rollout/test_replica.py (host)."""

import pytest

from reprorl.trainer import weight_sync


class FakeActor:
    def __init__(self, uuid):
        self.uuid, self.calls = uuid, []

    def gpu_uuid(self):
        return self.uuid

    def named_weights(self):
        self.calls.append("named_weights")
        return [("w", "tensor")]

    def share_weights(self, consumers):
        self.calls.append(("share_weights", consumers))
        return [f"share {k}" for k in range(consumers)]

    def release_shared_weights(self):
        self.calls.append("release")


class FakePool:
    def __init__(self, uuids, fail=False):
        self.uuids, self.fail, self.pushes = uuids, fail, []
        self.replicas = dict.fromkeys(uuids)

    def gpu_uuids(self):
        return self.uuids

    def update_weights(self, named, version):
        self.pushes.append(("host", list(named), version))

    def update_weights_shared(self, shares, version, host_weights):
        self.pushes.append(("device", shares, version, host_weights))
        if self.fail:
            raise RuntimeError("a replica failed")


def test_only_replicas_on_the_actors_gpu_take_the_device_path():
    pool = FakePool({0: "GPU-a", 1: "GPU-b", 2: "GPU-a", 3: None})
    assert weight_sync.device_replicas(FakeActor("GPU-a"), pool) == [0, 2]
    assert weight_sync.device_replicas(FakeActor("GPU-c"), pool) == []
    assert weight_sync.device_replicas(FakeActor(None), pool) == []  # the actor on the CPU


def test_without_device_replicas_the_push_is_todays_host_push():
    actor, pool = FakeActor(None), FakePool({0: None, 1: None})
    weight_sync.push_weights(actor, pool, 3, on_device=[])
    assert pool.pushes == [("host", [("w", "tensor")], 3)] and actor.calls == ["named_weights"]


def test_device_push_gives_each_replica_its_own_share_then_frees_the_buffer():
    actor, pool = FakeActor("GPU-a"), FakePool({0: "GPU-a", 1: "GPU-b", 2: "GPU-a"})
    weight_sync.push_weights(actor, pool, 4, on_device=[0, 2])
    (kind, shares, version, host_weights), = pool.pushes
    assert (kind, shares, version) == ("device", {0: "share 0", 2: "share 1"}, 4)
    assert host_weights == actor.named_weights  # for replica 1 and replacements, fetched only by the pool
    assert actor.calls == [("share_weights", 2), "release"]


def test_a_replaced_replica_is_left_to_the_host_path():
    actor, pool = FakeActor("GPU-a"), FakePool({0: "GPU-a", 5: "GPU-a"})
    weight_sync.push_weights(actor, pool, 2, on_device=[0, 1])  # 1 died and became 5 since
    assert pool.pushes[0][1] == {0: "share 0"}


def test_the_buffer_is_freed_when_the_push_fails():
    actor, pool = FakeActor("GPU-a"), FakePool({0: "GPU-a"}, fail=True)
    with pytest.raises(RuntimeError, match="a replica failed"):
        weight_sync.push_weights(actor, pool, 2, on_device=[0])
    assert actor.calls == [("share_weights", 1), "release"]
