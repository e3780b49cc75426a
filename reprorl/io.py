"""Files written all or nothing: the one atomic write of the package.

    with atomic_write(path) as tmp:   # a fresh temp file beside `path`
        torch.save(data, tmp)         # fill it by any means that takes a path

On a clean exit the temp file gets the mode a new file gets (umask applied: mkstemp and
safetensors make 0600), is fsynced and renamed over `path`, and the directory is fsynced;
on an error it is removed and `path` keeps its old bytes. A crash leaves the old file or
the new one, never half of one, plus at worst a `TMP_PREFIX` file that a directory's
owner may delete (checkpoints and fingerprints do).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TMP_PREFIX = ".tmp-"
"""How temp files and directories of atomic writes start, so their leftovers can be found."""

_UMASK = os.umask(0)
os.umask(_UMASK)  # read once, at import: setting it back and forth later would race with threads


@contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Path]:
    """A temp path in `path`'s directory; moved onto `path` when the block succeeds (see module doc)."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}-", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_UMASK)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory `path` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
