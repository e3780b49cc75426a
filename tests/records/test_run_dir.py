"""The run directory's lock (one training process at a time) and its history file."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from reprorl.records.run_dir import HISTORY_FILE, LOCK_FILE, RunDirBusyError, append_history, lock_run_dir


def test_a_second_lock_is_refused_naming_the_holder(tmp_path):
    with lock_run_dir(tmp_path / "run") as lock:
        holder = json.loads(lock.path.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(RunDirBusyError) as err:
            lock_run_dir(tmp_path / "run")
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(f"trainer.run_dir {str(tmp_path / 'run')!r} is in use by another run "
                                  f"(pid {os.getpid()} on host {socket.gethostname()} since {holder['started']}")
        assert message.endswith("wait for it to end or stop it, or choose another trainer.run_dir")
    with lock_run_dir(tmp_path / "run"):  # released: the next run takes it
        pass


def test_the_lock_goes_with_a_killed_holder(tmp_path):
    """A holder killed with SIGKILL (no cleanup) leaves the directory free."""
    script = textwrap.dedent(f"""
        import sys, time
        from reprorl.records.run_dir import lock_run_dir
        lock = lock_run_dir({str(tmp_path)!r})
        print("locked", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "locked\n"
        with pytest.raises(RunDirBusyError, match=rf"in use by another run \(pid {proc.pid} on host "):
            lock_run_dir(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    with lock_run_dir(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_history_lines_append(tmp_path):
    append_history(tmp_path, {"event": "start", "step": 0})
    append_history(tmp_path, {"event": "resume", "step": 3})
    lines = [json.loads(line) for line in (tmp_path / HISTORY_FILE).read_text().splitlines()]
    assert [(r["event"], r["step"], r["pid"]) for r in lines] == [("start", 0, os.getpid()), ("resume", 3, os.getpid())]
