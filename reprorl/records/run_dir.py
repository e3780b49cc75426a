"""The run directory's owner and its history: one training process at a time, and a record of each start.

`lock_run_dir(run_dir)` takes an exclusive `fcntl.flock` on `run_dir/run.lock` for the
run's life and writes the holder (pid, host, start time) into it. A second `reprorl train`
on the same directory (a requeued job while the first is alive) would delete the first's
checkpoint in progress and interleave lines of `metrics.jsonl`; it stops instead with a
one-line error naming the holder. The kernel releases the lock when the holder's process
dies, however it dies, so a crashed run never leaves the directory locked. The file is
never deleted: a process waiting on a deleted file would lock a name nobody else sees.

`append_history(run_dir, event)` appends one JSON line to `run_dir/history.jsonl`: each
start of the run, from which step, and the config keys that changed since its checkpoint.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from reprorl.errors import ReproRLError

LOCK_FILE = "run.lock"
HISTORY_FILE = "history.jsonl"


class RunDirBusyError(ReproRLError):
    """Another live process holds the run directory."""


class RunDirLock:
    """The held lock of one run directory; `release()` (or the process's end) lets it go."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # nobody holds it now: no stale holder to read
            os.close(self._fd)  # closing the last descriptor of the file releases the flock
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_run_dir(run_dir: str | os.PathLike) -> RunDirLock:
    """Lock `run_dir` (created if missing) for this process, or raise `RunDirBusyError`
    naming the process that holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the processes the run starts
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirBusyError(
            f"trainer.run_dir {str(run_dir)!r} is in use by another run ({_holder(path)}, in {str(path)!r}): "
            "wait for it to end or stop it, or choose another trainer.run_dir"
        ) from None
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    return RunDirLock(path, fd)


def _holder(path: Path) -> str:
    """"pid 12 on host h since <time>", from the lock file the holder wrote."""
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        return f"pid {holder['pid']} on host {holder['host']} since {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet written its pid"  # it took the lock an instant ago


def append_history(run_dir: str | os.PathLike, event: dict[str, Any]) -> None:
    """Append `event` (JSON values), with the time, host and pid, as one line of history.jsonl."""
    record = {"time": _now(), "host": socket.gethostname(), "pid": os.getpid(), **event}
    with open(Path(run_dir) / HISTORY_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
