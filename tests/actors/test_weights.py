"""Weight pushes as flat buffers (reprorl/actors/weights.py): the packing both paths share,
and what the CUDA IPC path refuses (the rest of it needs a GPU: tests/trainer/test_weight_sync_gpu.py)."""

import pytest
import torch

from reprorl.actors.weights import PackedWeights, SharedWeights, share


def _named():
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(3, 4, generator=g).to(torch.bfloat16)), ("b", torch.randn(5, generator=g)),
            ("c", torch.randn(2, 2, generator=g).to(torch.bfloat16))]


def test_pack_lays_out_each_dtype_in_push_order():
    packed = PackedWeights.pack(_named(), device="cpu")
    assert packed.entries == (("a", "bfloat16", (3, 4), 0), ("b", "float32", (5,), 0), ("c", "bfloat16", (2, 2), 12))
    assert sorted(packed.buffers) == ["bfloat16", "float32"]  # one flat buffer per dtype, nothing else
    assert packed.buffers["bfloat16"].device.type == "cpu"
    # the buffer IS the tensors one after another: [a flattened, c flattened]
    named = dict(_named())
    assert torch.equal(packed.buffers["bfloat16"], torch.cat([named["a"].reshape(-1), named["c"].reshape(-1)]))


def test_unpack_gives_views_of_one_moved_buffer_in_push_order():
    packed = PackedWeights.pack(_named())
    unpacked = packed.unpack("cpu")
    assert [name for name, _ in unpacked] == ["a", "b", "c"]
    out = dict(unpacked)
    assert out["a"].untyped_storage().data_ptr() == out["c"].untyped_storage().data_ptr()
    for name, want in _named():
        assert out[name].dtype == want.dtype and torch.equal(out[name], want)


def test_shared_weights_carry_no_tensor_and_name_the_same_entries():
    packed = PackedWeights.pack(_named())
    shared = SharedWeights(packed.entries, {}, "GPU-test")
    assert shared.names == packed.names == {"a", "b", "c"}


def test_share_refuses_host_buffers():
    with pytest.raises(ValueError, match=r"share: the buffers are on \['cpu'\]; expected one cuda device"):
        share(PackedWeights.pack(_named()), 1)


def test_open_refuses_a_cpu_device():
    shared = SharedWeights(PackedWeights.pack(_named()).entries, {}, "GPU-test")
    with pytest.raises(ValueError, match="CUDA IPC needs a cuda device"):
        shared.open("cpu")


def test_open_checks_the_gpu_and_names_this_process_device(monkeypatch):
    """A share names the producer's device index; the consumer's may differ (another
    CUDA_VISIBLE_DEVICES): `open` puts its own in, once the GPU's UUID matches."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from reprorl.actors import weights

    monkeypatch.setattr(weights, "gpu_uuid", lambda device: "GPU-here")
    device_arg = list(inspect.signature(rebuild_cuda_tensor).parameters).index("storage_device")
    calls = []

    def rebuild(*args):
        calls.append(args)
        return torch.arange(6, dtype=torch.float32)

    args = tuple(f"arg{k}" for k in range(15))
    entries = (("w", "float32", (2, 3), 0),)
    packed = SharedWeights(entries, {"float32": (rebuild, args)}, "GPU-here").open("cuda:2")
    (got,) = calls
    assert got[device_arg] == 2 and got[:device_arg] + got[device_arg + 1:] == args[:device_arg] + args[device_arg + 1:]
    assert torch.equal(dict(packed.unpack("cpu"))["w"], torch.arange(6, dtype=torch.float32).view(2, 3))
    with pytest.raises(ValueError, match="the weights are on GPU GPU-there; CUDA IPC reaches only the same GPU"):
        SharedWeights(entries, {"float32": (rebuild, args)}, "GPU-there").open("cuda:2")
    assert len(calls) == 1  # refused before opening anything
