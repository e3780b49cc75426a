"""The sandbox's launcher: run as a script by a fresh interpreter, it isolates itself and execs the program.

    python -I -S launcher.py SPEC_JSON STATUS_FD

It imports nothing of reprorl (the runner starts it by path, `runner.py`), and runs as root:

1. joins the program's pids cgroup (`pids.max` bounds its processes: RLIMIT_NPROC does not
   bind root), then unshares a mount, network and PID namespace;
2. forks: the child is PID 1 of the new PID namespace, so when it exits the kernel kills
   every process the program left (a fork bomb, a daemon that called setsid);
3. the child mounts a size-capped tmpfs on the work directory (the only writable place), a
   /proc of its own namespace, and remounts every other mount read-only; sets the
   rlimits; drops every capability (bounding set included, and no_new_privs) so the
   program cannot undo a mount or signal a process outside; and execs the program with
   the given environment, in the work directory. The network namespace has only a
   loopback device, down: no address reaches anything;
4. the launcher waits for it and writes {"exit", "signal", "cpu_s"} to STATUS_FD.

A step that fails before the exec writes {"isolation": reason} to STATUS_FD instead, which
the program never sees (the descriptor closes at the exec): the runner turns it into a
`SandboxError`, never a run without isolation.
"""

import ctypes
import json
import os
import resource
import signal
import sys

ISOLATION_EXIT = 125  # the exit code after an isolation failure (the status line says why)
CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x40000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
_LIBC = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_LIBC.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def _mount_points() -> list[tuple[str, set[str]]]:
    """(mount point, its per-mount options) of every mount this namespace sees, in mount order."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
            points.append((point, set(fields[5].split(","))))
    return points


def _read_only_except(work: str) -> None:
    """Remount every mount but `work` read-only (and nosuid), keeping its nodev/noexec."""
    seen = set()
    for point, options in reversed(_mount_points()):  # the top mount of a stacked point comes last
        if point in seen or point == work:
            continue
        seen.add(point)
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        flags |= (MS_NODEV if "nodev" in options else 0) | (MS_NOEXEC if "noexec" in options else 0)
        try:
            _mount(None, point, None, flags)
        except OSError:
            if not os.path.exists(point):  # hidden under a later mount: the program cannot reach it
                continue
            raise


def _drop_capabilities() -> None:
    for cap in range(64):
        if _LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: no such cap
            _check(-1, f"drop capability {cap}")
    _check(_LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all empty (two 32-bit words)
    _check(_LIBC.capset(header, data), "capset")


def _set_limits(limits: dict) -> None:
    cpu = int(limits["cpu_s"])  # soft = hard: PID 1 ignores SIGXCPU, the hard limit's SIGKILL ends it
    for name, value in (("RLIMIT_CPU", cpu), ("RLIMIT_AS", limits["memory_bytes"]),
                        ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_NOFILE", limits["open_files"]),
                        ("RLIMIT_NPROC", limits["processes"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))


def _report(status_fd: int, **fields) -> None:
    os.write(status_fd, (json.dumps(fields) + "\n").encode())


def _child(spec: dict, status_fd: int) -> None:
    """PID 1 of the namespace: the filesystem, the limits, no capabilities, then the program."""
    work = spec["work_dir"]
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['limits']['tmpfs_bytes']},mode=0777")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _read_only_except(work)
    os.chdir(work)
    _set_limits(spec["limits"])
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the launcher gone: end the namespace
    _drop_capabilities()
    os.set_inheritable(status_fd, False)  # the program must not write a status of its own
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def main() -> None:
    spec, status_fd = json.loads(sys.argv[1]), int(sys.argv[2])
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the runner gone: so are we
    try:
        with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        _check(_LIBC.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare(mount, network, pid)")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    except OSError as err:
        _report(status_fd, isolation=err.strerror or str(err))
        os._exit(ISOLATION_EXIT)
    pid = os.fork()
    if pid == 0:
        try:
            _child(spec, status_fd)
        except BaseException as err:  # noqa: BLE001 - any failure before the exec is an isolation failure
            _report(status_fd, isolation=getattr(err, "strerror", None) or str(err))
        os._exit(ISOLATION_EXIT)
    _, status, usage = os.wait4(pid, 0)
    _report(status_fd, exit=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            cpu_s=usage.ru_utime + usage.ru_stime)


if __name__ == "__main__":
    main()
