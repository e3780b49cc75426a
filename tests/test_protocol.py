"""Tests for reprorl.protocol.Batch on a small literal batch with mixed columns."""

import os

import numpy as np
import pytest
import torch

from reprorl.errors import DataError
from reprorl.protocol import Batch

# Row i of the literal batch below, as Python values: (input_ids, score, values, uid, extra).
ROWS = [
    ([1, 2, 3], 0.5, [[0.0, 1.0], [2.0, 3.0]], "a", {"i": 0}),
    ([4, 5, 6], -1.0, [[4.0, 5.0], [6.0, 7.0]], "b", {"i": 1, "tags": ["x"]}),
    ([7, 8, 9], 2.25, [[8.0, 9.0], [10.0, 11.0]], "c", {"i": 2}),
    ([10, 11, 12], 3.0, [[12.0, 13.0], [14.0, 15.0]], "d", {"i": 3, "tags": []}),
]


def make_batch() -> Batch:
    return Batch(
        tensors={
            "input_ids": torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]),  # int64 [4, 3]
            "score": torch.tensor([0.5, -1.0, 2.25, 3.0]),  # float32 [4]
            "values": torch.arange(16, dtype=torch.float64).reshape(4, 2, 2),  # float64 [4, 2, 2]
        },
        non_tensors={
            "uid": ["a", "b", "c", "d"],
            "extra": [{"i": 0}, {"i": 1, "tags": ["x"]}, {"i": 2}, {"i": 3, "tags": []}],
        },
        meta={"step": 7, "validate": False},
    )


def rows(batch: Batch) -> list[tuple]:
    """The batch as a list of per-row Python tuples, in the layout of ROWS."""
    return [
        (
            batch["input_ids"][i].tolist(),
            batch["score"][i].item(),
            batch["values"][i].tolist(),
            batch["uid"][i],
            batch["extra"][i],
        )
        for i in range(len(batch))
    ]


def check_dtypes(batch: Batch) -> None:
    assert batch["input_ids"].dtype == torch.int64
    assert batch["score"].dtype == torch.float32
    assert batch["values"].dtype == torch.float64
    assert batch["uid"].dtype == object and batch["uid"].ndim == 1
    assert batch["extra"].dtype == object and batch["extra"].ndim == 1


# ---- construction and access ----------------------------------------------------------


def test_construction_and_access():
    b = make_batch()
    assert len(b) == 4
    assert b.keys() == ["input_ids", "score", "values", "uid", "extra"]
    assert "uid" in b and "nope" not in b
    assert rows(b) == ROWS
    check_dtypes(b)
    assert b["values"].shape == (4, 2, 2)
    assert b.meta == {"step": 7, "validate": False}
    assert len(Batch()) == 0 and Batch().keys() == []


def test_list_of_equal_length_lists_is_one_entry_per_row():
    b = Batch(non_tensors={"ids": [[1, 2], [3, 4], [5, 6]]})
    assert b["ids"].shape == (3,)
    assert b["ids"][1] == [3, 4]
    # numpy arrays of other dtypes become object arrays of Python values
    b = Batch(non_tensors={"n": np.array([1, 2]), "s": np.array(["x", "y"])})
    assert b["n"].dtype == object and type(b["n"][0]) is int
    assert b["s"].tolist() == ["x", "y"] and type(b["s"][0]) is str


def test_construction_errors():
    with pytest.raises(ValueError, match=r"column 'uid' has 3 rows but column 'x' has 2"):
        Batch({"x": torch.zeros(2)}, {"uid": ["a", "b", "c"]})
    with pytest.raises(ValueError, match=r"column 'y' has 3 rows but column 'x' has 2"):
        Batch({"x": torch.zeros(2, 5), "y": torch.zeros(3, 5)})
    with pytest.raises(ValueError, match=r"'x' is a 0-d tensor"):
        Batch({"x": torch.tensor(1.0)})
    with pytest.raises(ValueError, match=r"keys \['x'\] are both tensor and non-tensor"):
        Batch({"x": torch.zeros(2)}, {"x": [1, 2]})
    with pytest.raises(TypeError, match=r"non-tensor column 'uid' must be a list.*got str"):
        Batch(non_tensors={"uid": "ab"})
    with pytest.raises(ValueError, match=r"non-tensor column 'm' must be 1-D.*\(2, 2\)"):
        Batch(non_tensors={"m": np.zeros((2, 2))})
    with pytest.raises(TypeError, match=r"tensor column 'x' is a list"):
        Batch({"x": [1, 2]})


def test_getitem_errors():
    b = make_batch()
    with pytest.raises(KeyError, match=r"no column 'nope'; tensor columns \['input_ids', 'score', 'values'\]"):
        b["nope"]
    with pytest.raises(TypeError, match=r"takes a column name, got int"):
        b[0]


def test_setitem_adds_columns_and_checks_length():
    b = make_batch()
    b["adv"] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    b["note"] = ["w", "x", "y", "z"]
    assert b["adv"].tolist() == [1.0, 2.0, 3.0, 4.0] and b["note"].tolist() == ["w", "x", "y", "z"]
    b["score"] = torch.zeros(4)  # replacing a column is allowed
    assert b["score"].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match=r"column 'bad' has 3 rows but column 'input_ids' has 4"):
        b["bad"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'uid' is a non-tensor column"):
        b["uid"] = torch.zeros(4)
    assert "bad" not in b


def test_repr_shows_keys_shapes_dtypes():
    assert repr(make_batch()) == (
        "Batch(len=4, tensors={input_ids: int64[4, 3], score: float32[4], values: float64[4, 2, 2]}, "
        "non_tensors={uid: object[4], extra: object[4]}, meta_keys=['step', 'validate'])"
    )


def test_equal_is_exact():
    assert make_batch().equal(make_batch())
    other = make_batch()
    other.tensors["score"] = other["score"].double()  # same values, other dtype
    assert not make_batch().equal(other)
    other = make_batch()
    other["values"][3, 1, 1] = 15.000001
    assert not make_batch().equal(other)
    other = make_batch()
    other["extra"][1] = {"i": 1, "tags": ["y"]}
    assert not make_batch().equal(other)
    other = make_batch()
    other.meta["step"] = 8
    assert not make_batch().equal(other)


# ---- rows -----------------------------------------------------------------------------


def test_slice_is_a_view_with_its_own_meta():
    b = make_batch()
    s = b.slice(1, 3)
    assert rows(s) == ROWS[1:3]
    check_dtypes(s)
    assert rows(b.slice(2)) == ROWS[2:] and len(b.slice(4, 4)) == 0
    s["score"][0] = 100.0  # a view: the parent sees the write
    assert b["score"][1].item() == 100.0
    s.meta["step"] = 99  # meta is a copy
    assert b.meta["step"] == 7 and s.meta == {"step": 99, "validate": False}
    with pytest.raises(IndexError, match=r"slice\(3, 5\) is out of range for a batch of 4 rows"):
        b.slice(3, 5)
    with pytest.raises(IndexError, match=r"slice\(-1, 2\)"):
        b.slice(-1, 2)


def test_index_by_every_kind_of_index():
    b = make_batch()
    expected = [ROWS[2], ROWS[0], ROWS[0], ROWS[3]]
    for idx in ([2, 0, 0, 3], (2, 0, 0, -1), torch.tensor([2, 0, 0, 3]),
                np.array([2, 0, 0, 3], dtype=np.int32)):
        got = b.index(idx)
        assert rows(got) == expected, idx
        check_dtypes(got)
    for mask in ([False, True, False, True], torch.tensor([False, True, False, True]),
                 np.array([False, True, False, True])):
        assert rows(b.index(mask)) == [ROWS[1], ROWS[3]]
    assert len(b.index([])) == 0 and b.index([])["values"].shape == (0, 2, 2)
    got = b.index([0])
    got["input_ids"][0, 0] = -5  # a copy: the parent is unchanged
    assert b["input_ids"][0, 0].item() == 1
    assert got.meta == b.meta and got.meta is not b.meta


def test_index_errors():
    b = make_batch()
    with pytest.raises(IndexError, match=r"row index 4 is out of range for a batch of 4 rows"):
        b.index([0, 4])
    with pytest.raises(IndexError, match=r"row index -5 is out of range for a batch of 4 rows"):
        b.index(torch.tensor([-5]))
    with pytest.raises(IndexError, match=r"boolean mask has length 3 but the batch has 4 rows"):
        b.index([True, False, True])
    with pytest.raises(TypeError, match=r"all ints or all bools, got 1.0"):
        b.index([0, 1.0])
    with pytest.raises(TypeError, match=r"all ints or all bools, got True"):
        b.index([0, True])
    with pytest.raises(TypeError, match=r"integers or a boolean mask, got dtype torch.float32"):
        b.index(torch.tensor([0.0]))


def test_repeat_interleaved_and_tiled():
    b = make_batch().slice(0, 2)
    inter = b.repeat(2)
    assert inter["uid"].tolist() == ["a", "a", "b", "b"]
    assert inter["input_ids"].tolist() == [[1, 2, 3], [1, 2, 3], [4, 5, 6], [4, 5, 6]]
    assert rows(inter) == [ROWS[0], ROWS[0], ROWS[1], ROWS[1]]
    tiled = b.repeat(3, interleave=False)
    assert tiled["uid"].tolist() == ["a", "b", "a", "b", "a", "b"]
    assert tiled["values"].tolist() == [ROWS[0][2], ROWS[1][2]] * 3
    assert rows(tiled) == [ROWS[0], ROWS[1]] * 3
    check_dtypes(inter)
    check_dtypes(tiled)
    assert b.repeat(1).equal(b)
    with pytest.raises(ValueError, match=r"repeat needs n >= 1, got 0"):
        b.repeat(0)


def test_concat():
    b = make_batch()
    got = Batch.concat([b.slice(2, 4), b.slice(0, 1), b.slice(1, 2)])
    assert rows(got) == [ROWS[2], ROWS[3], ROWS[0], ROWS[1]]
    check_dtypes(got)
    assert got.meta == {"step": 7, "validate": False}
    # meta keys that only a later batch has are kept; equal values are not a conflict
    x, y = b.slice(0, 2), b.slice(2, 4)
    y.meta["t_gen"] = 1.5
    assert Batch.concat([x, y]).meta == {"step": 7, "validate": False, "t_gen": 1.5}
    assert Batch.concat([b]).equal(b)


def test_concat_errors():
    b = make_batch()
    other = b.slice(0, 2)
    other.pop(tensor_keys=["score"], non_tensor_keys=["uid"])
    other["z"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"batch 1 has different tensor keys from batch 0: "
                                         r"missing \['score'\], extra \['z'\]"):
        Batch.concat([b, other])
    other = b.slice(0, 2)
    other.pop(non_tensor_keys=["extra"])
    with pytest.raises(ValueError, match=r"batch 1 has different non-tensor keys.*missing \['extra'\], extra \[\]"):
        Batch.concat([b, other])
    other = b.slice(0, 2)
    other.meta["step"] = 8
    with pytest.raises(ValueError, match=r"meta 'step' is 7 in an earlier batch but 8 in batch 2"):
        Batch.concat([b, b, other])
    other = b.slice(0, 2)
    other.tensors["score"] = other["score"].double()
    with pytest.raises(ValueError, match=r"tensor 'score' is torch.float32\[4\] in batch 0 "
                                         r"but torch.float64\[2\] in batch 1"):
        Batch.concat([b, other])
    with pytest.raises(ValueError, match=r"at least one batch"):
        Batch.concat([])


def test_split():
    b = make_batch()
    halves = b.split(2)
    assert [rows(h) for h in halves] == [ROWS[0:2], ROWS[2:4]]
    assert [rows(p) for p in b.split(3)] == [ROWS[0:3], ROWS[3:4]]
    assert [rows(p) for p in b.split(4)] == [ROWS]
    assert [len(p) for p in b.split(1)] == [1, 1, 1, 1]
    halves[1].meta["step"] = 0
    assert b.meta["step"] == 7
    with pytest.raises(ValueError, match=r"split needs size >= 1, got 0"):
        b.split(0)


# ---- columns --------------------------------------------------------------------------


def test_pop_removes_and_returns():
    b = make_batch()
    popped = b.pop(tensor_keys=["values"], non_tensor_keys=["extra"], meta_keys=["validate"])
    assert popped.keys() == ["values", "extra"] and popped.meta == {"validate": False}
    assert popped["values"].tolist() == [r[2] for r in ROWS]
    assert popped["extra"].tolist() == [r[4] for r in ROWS]
    assert b.keys() == ["input_ids", "score", "uid"] and b.meta == {"step": 7}
    assert b.pop().keys() == []  # None pops nothing
    with pytest.raises(KeyError, match=r"pop: no meta key\(s\) \['validate'\]"):
        b.pop(tensor_keys=["score"], meta_keys=["validate"])
    assert "score" in b  # nothing removed when a key is missing


# ---- device and files -----------------------------------------------------------------


def test_to_moves_tensors_only():
    b = make_batch()
    moved = b.to("meta")  # the meta device exists on every build, so this is a real move
    assert all(t.device.type == "meta" for t in moved.tensors.values())
    assert moved["values"].shape == (4, 2, 2) and moved["uid"] is b["uid"]
    assert moved.meta == b.meta and moved.meta is not b.meta
    assert rows(b.to("cpu")) == ROWS


def test_save_load_round_trip(tmp_path):
    b = make_batch()
    b.meta.update({"timing": {"gen": 1.25, "reward": 0.5}, "name": None, "pair": (1, "x")})
    b["nested"] = [[1, 2], (3, "t"), {"k": [None, 2.5]}, b"raw"]
    path = tmp_path / "batch.pt"
    b.save(path)
    loaded = Batch.load(path)
    assert loaded.keys() == b.keys()
    for key, t in b.tensors.items():
        assert loaded[key].dtype == t.dtype and torch.equal(loaded[key], t)
    for key, a in b.non_tensors.items():
        assert loaded[key].dtype == object and loaded[key].shape == a.shape
        assert loaded[key].tolist() == a.tolist()
    assert loaded["nested"][1] == (3, "t") and type(loaded["nested"][1]) is tuple
    assert loaded.meta == b.meta and type(loaded.meta["pair"]) is tuple
    assert loaded.equal(b)
    assert os.listdir(tmp_path) == ["batch.pt"]  # no temp file left behind


def test_save_of_a_view_writes_only_its_rows(tmp_path):
    big = Batch({"x": torch.arange(100_000)})
    big.slice(10, 12).save(tmp_path / "small.pt")
    loaded = Batch.load(tmp_path / "small.pt")
    assert loaded["x"].tolist() == [10, 11]
    assert loaded["x"].untyped_storage().nbytes() == 2 * 8
    assert os.path.getsize(tmp_path / "small.pt") < 10_000


def test_save_refuses_values_load_could_not_read(tmp_path):
    b = make_batch()
    b.meta["mean"] = np.float64(0.5)
    with pytest.raises(TypeError, match=r"cannot save meta 'mean': a numpy.float64.*use .item\(\)"):
        b.save(tmp_path / "b.pt")
    b = make_batch()
    b["extra"][2] = {"i": np.int64(2)}
    with pytest.raises(TypeError, match=r"cannot save non-tensor 'extra' row 2\['i'\]: a numpy.int64"):
        b.save(tmp_path / "b.pt")
    assert os.listdir(tmp_path) == []


def test_crash_during_save_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "b.pt"
    make_batch().slice(0, 1).save(path)
    before = path.read_bytes()

    def half_write_then_crash(obj, f):
        with open(f, "wb") as out:
            out.write(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch, "save", half_write_then_crash)
    with pytest.raises(RuntimeError, match="disk full"):
        make_batch().save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["b.pt"]


def test_load_errors(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(DataError, match=r"bad.pt: not a readable batch file"):
        Batch.load(bad)
    other = tmp_path / "other.pt"
    torch.save({"x": torch.zeros(2)}, other)
    with pytest.raises(DataError, match=r"other.pt: not a reprorl batch file"):
        Batch.load(other)
    with pytest.raises(FileNotFoundError):
        Batch.load(tmp_path / "missing.pt")
