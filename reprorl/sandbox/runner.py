"""Run one untrusted program, isolated and under limits: `run(files, argv, stdin, limits) -> Result`.

Each program gets a fresh directory of its files (read-only to it), a tmpfs work directory
(its only writable place, its cwd), no network, its own PID namespace, a pids cgroup, the
rlimits of `Limits`, no capabilities and a clean environment (`ENV`); `launcher.py` does
the isolating. Its stdout and stderr are read up to `Limits.output_bytes`; past that, or
past the wall-clock backstop, the whole process group and cgroup is killed. When `run`
returns, no process of the program is left and its directory and cgroup are gone.

Verdicts count CPU time, not wall time (RLIMIT_CPU), so a loaded machine does not change
them; the wall-clock backstop (`Limits.wall_s`) is far above the CPU limit and only ends
programs that wait without computing (a `sleep`, a read that never comes). Where a
program near a limit can still flip: docs/code.md.

Languages: a program is its files and an argv (`LANGUAGES` builds Python's); anything
the machine can exec inside the read-only filesystem works the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from reprorl.errors import ReproRLError

LAUNCHER = Path(__file__).with_name("launcher.py")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
       "PYTHONIOENCODING": "utf-8", "HOME": "/nonexistent"}
"""The program's whole environment: nothing of the caller's (keys, tokens, paths) reaches it."""
CGROUP_DIR = "reprorl-sandbox"  # under the pids hierarchy; one child cgroup per program
_MiB = 1 << 20

logger = logging.getLogger(__name__)


class SandboxError(ReproRLError):
    """The sandbox cannot isolate a program on this machine: it refuses to run it unisolated."""


@dataclass(frozen=True)
class Limits:
    """What one program may use. CPU seconds are whole seconds (RLIMIT_CPU's unit)."""

    cpu_s: int = 4
    memory_bytes: int = 1024 * _MiB  # address space (RLIMIT_AS), per process
    file_bytes: int = 16 * _MiB  # largest file it may write (RLIMIT_FSIZE)
    tmpfs_bytes: int = 32 * _MiB  # its work directory in all
    open_files: int = 64
    processes: int = 16  # pids.max of its cgroup (RLIMIT_NPROC does not bind root)
    output_bytes: int = 1 * _MiB  # stdout and stderr each; past it the program is killed

    @property
    def wall_s(self) -> float:
        """The wall-clock backstop: 10x the CPU limit and 5 s, for programs that wait without computing."""
        return 10.0 * self.cpu_s + 5.0


@dataclass(frozen=True)
class Result:
    """How a program ended. `status`: "ok" (exit 0), "error" (another exit or a signal),
    "timeout" (CPU limit, or the wall backstop) or "output_limit"."""

    status: str
    stdout: str
    stderr: str
    exit_code: int | None = None
    signal: int | None = None
    cpu_s: float = 0.0


# Runs a script as __main__ with `random` seeded, so a program that draws without a seed
# prints the same every run; the traceback names the file "main.py", not its temp path.
_PYTHON_PRELUDE = ("import random, sys; random.seed(0); path = sys.argv[1]; sys.argv = ['main.py']; "
                   "code = compile(open(path, encoding='utf-8').read(), 'main.py', 'exec'); del path; "
                   "exec(code, {'__name__': '__main__', '__builtins__': __builtins__})")


def python_argv(script: str) -> list[str]:
    """The argv that runs `script` (a file of the program's directory) with this interpreter:
    no site-packages (-S, -s: the standard library only, the same on every machine)."""
    return [sys.executable, "-S", "-s", "-B", "-c", _PYTHON_PRELUDE, script]


LANGUAGES = {"python": python_argv}
"""language -> (the program's main file) -> argv. A new language adds its builder here."""


def run(files: dict[str, str], argv: list[str], stdin: str = "", limits: Limits = Limits()) -> Result:
    """Run `argv` (a `LANGUAGES` builder's, with file names of `files`) on `stdin`.

    `files`: name -> text, written to the program's directory (read-only to it); `argv`
    names them as `{dir}/name` (the placeholder is filled in). Raises `SandboxError` if
    the program cannot be isolated here.

    A program SIGKILLed before its CPU limit was killed from outside (the OOM killer, an
    operator): a verdict of the machine's, not of the program's, so it runs once more, as
    a rule-reward worker's call that died does; a second such end is its verdict ("error").
    """
    _check_root()
    result = _run_once(files, argv, stdin, limits)
    if _killed_from_outside(result, limits):
        logger.warning("a sandboxed program was SIGKILLed after %.2f s of its %d s of CPU time; it runs once more",
                       result.cpu_s, limits.cpu_s)
        result = _run_once(files, argv, stdin, limits)
    return result


def _killed_from_outside(result: Result, limits: Limits) -> bool:
    return result.status == "error" and result.signal == signal.SIGKILL and result.cpu_s < limits.cpu_s - 0.05


def _run_once(files: dict[str, str], argv: list[str], stdin: str, limits: Limits) -> Result:
    root = Path(tempfile.mkdtemp(prefix=f"reprorl-sandbox-{os.getpid()}-"))  # whose it is, as its cgroup's name
    cgroup = _new_cgroup(limits.processes)
    try:
        for name, text in files.items():
            (root / name).write_text(text, encoding="utf-8")
        (root / "stdin").write_text(stdin, encoding="utf-8")
        (root / "work").mkdir()
        spec = {"work_dir": str(root / "work"), "cgroup": str(cgroup), "env": ENV,
                "argv": [a.replace("{dir}", str(root)) for a in argv],
                "limits": {**dataclasses.asdict(limits)}}
        return _launch(spec, root / "stdin", limits)
    finally:
        _remove_cgroup(cgroup)
        shutil.rmtree(root, ignore_errors=True)


def run_python(source: str, stdin: str = "", limits: Limits = Limits()) -> Result:
    """`run` of one Python file, `source`."""
    return run({"main.py": source}, python_argv("{dir}/main.py"), stdin, limits)


@functools.cache
def require_isolation() -> None:
    """Raise `SandboxError` (one line: why) unless a program can be isolated here; checked once
    per process, where a run starts, so that no run ever scores a program unisolated."""
    result = run_python("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
                        "    print('network')\nexcept OSError:\n    print('no network')\n")
    if result.status != "ok" or result.stdout.strip() != "no network":
        raise SandboxError(f"the sandbox's probe program did not run isolated (status {result.status}, "
                           f"output {result.stdout.strip()!r}, {result.stderr.strip()[-200:]!r})")


def _check_root() -> None:
    if os.geteuid() != 0:
        raise SandboxError("the sandbox needs root (mount, network and PID namespaces, a pids cgroup; "
                           "docs/code.md); this process runs as uid " + str(os.geteuid()))


def _launch(spec: dict, stdin_path: Path, limits: Limits) -> Result:
    status_r, status_w = os.pipe()
    with open(stdin_path, "rb") as stdin:
        proc = subprocess.Popen([sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(spec), str(status_w)],
                                stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                                pass_fds=[status_w], start_new_session=True)
    os.close(status_w)
    try:
        stdout, stderr, cut = _read_capped(proc, limits)
    finally:
        _kill_group(proc)
        with os.fdopen(status_r, "rb") as f:
            lines = [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
    for line in lines:
        if "isolation" in line:
            raise SandboxError(f"the sandbox cannot isolate a program here: {line['isolation']} (it needs root "
                               "with mount, network and PID namespaces and a pids cgroup; docs/code.md)")
    out, err = stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace")
    if cut is not None or not lines:  # we killed it (no status: the launcher itself was killed)
        return Result(cut or "timeout", out, err)
    status = lines[-1]
    verdict = "ok" if status["exit"] == 0 else "error"
    if status["signal"] in (signal.SIGKILL, signal.SIGXCPU) and status["cpu_s"] >= limits.cpu_s - 0.05:
        verdict = "timeout"
    return Result(verdict, out, err, status["exit"], status["signal"], status["cpu_s"])


def _read_capped(proc: subprocess.Popen, limits: Limits) -> tuple[bytes, bytes, str | None]:
    """(stdout, stderr, None) once the program closed both; a third item "output_limit" or
    "timeout" when it was cut off (the caller kills it)."""
    chunks = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    deadline = time.monotonic() + limits.wall_s
    cut = None
    with selectors.DefaultSelector() as selector:
        for pipe in chunks:
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map() and cut is None:
            left = deadline - time.monotonic()
            if left <= 0:
                cut = "timeout"
                break
            for key, _ in selector.select(left):
                data = os.read(key.fileobj.fileno(), 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                chunks[key.fileobj] += data
                if len(chunks[key.fileobj]) > limits.output_bytes:
                    cut = "output_limit"
    proc.stdout.close()
    proc.stderr.close()
    return bytes(chunks[proc.stdout][: limits.output_bytes]), bytes(chunks[proc.stderr][: limits.output_bytes]), cut


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group and wait for it: its child (PID 1 of the program's
    namespace) dies with it, and with that PID 1 every process of the namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# --- the pids cgroup ------------------------------------------------------------------

_counter = itertools.count()


@functools.cache
def _cgroup_parent() -> Path:
    """The directory of this machine's sandbox cgroups (made on first use); stale ones of
    dead processes are removed. cgroup v1's pids hierarchy, or v2's with the pids controller."""
    for base in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        v2 = (base / "cgroup.controllers").is_file()
        if (base / "cgroup.procs").is_file() and (not v2 or "pids" in (base / "cgroup.subtree_control").read_text()):
            parent = base / CGROUP_DIR
            try:
                parent.mkdir(exist_ok=True)
            except OSError as err:
                raise SandboxError(f"the sandbox cannot make its pids cgroup {parent}: {err.strerror}") from None
            if v2:
                (parent / "cgroup.subtree_control").write_text("+pids")
            _remove_stale(parent)
            return parent
    raise SandboxError("the sandbox needs a pids cgroup (cgroup v1's /sys/fs/cgroup/pids, or v2 with the pids "
                       "controller enabled) to bound a program's processes; this machine has none")


def _new_cgroup(processes: int) -> Path:
    cgroup = _cgroup_parent() / f"{os.getpid()}-{next(_counter)}"
    cgroup.mkdir()
    (cgroup / "pids.max").write_text(str(processes))
    return cgroup


def _remove_cgroup(cgroup: Path) -> None:
    """Kill whatever is still in `cgroup` (nothing, normally: the namespace died) and remove it."""
    for _ in range(100):
        try:
            pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    for _ in range(100):
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY while the last members are reaped
            time.sleep(0.01)


def _remove_stale(parent: Path) -> None:
    """Remove the cgroups of processes that died without removing theirs (a SIGKILLed worker)."""
    for cgroup in parent.iterdir():
        owner = cgroup.name.split("-")[0]
        if cgroup.is_dir() and owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _remove_cgroup(cgroup)
