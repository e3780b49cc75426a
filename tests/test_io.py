"""reprorl.io.atomic_write: all or nothing, the mode of a new file, no temp file left."""

import os
import stat

import pytest
import torch

from reprorl.io import TMP_PREFIX, atomic_write
from reprorl.protocol import Batch


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_clean_block_replaces_the_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    with atomic_write(path) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(TMP_PREFIX + "f.bin-")
        tmp.write_bytes(b"new")
        assert path.read_bytes() == b"old"  # not before the block ends
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_an_error_keeps_the_old_file_and_removes_the_temp_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_write(path) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_files_get_the_mode_of_a_new_file(tmp_path):
    """mkstemp (and safetensors) make 0600 files; a saved batch was unreadable to the group."""
    umask = os.umask(0o022)
    try:
        plain = tmp_path / "plain"
        plain.write_bytes(b"")
        Batch({"x": torch.zeros(2)}).save(tmp_path / "batch.pt")
        assert _mode(tmp_path / "batch.pt") == _mode(plain) == 0o644
    finally:
        os.umask(umask)
