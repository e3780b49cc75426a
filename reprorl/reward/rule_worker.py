"""Rule reward functions in a child process, each call under a time limit.

    worker = RuleWorker(fn)
    outcomes = worker.run(calls, timeout_s=30.0, stop_at_timeout=False)  # an Outcome per call
    worker.close()

Why a process: a Python function that never returns cannot be stopped from another thread
(and a thread would take rule functions out of a main thread, where math-verify's own
timeout needs `signal.alarm`); a process can be killed. When a call passes its limit the
child is killed and a fresh one takes the calls after it. The child is a plain `python`
started with `subprocess` (`multiprocessing` would re-run the caller's `__main__`); the
function reaches it through cloudpickle (by reference when its module can be imported, by
value when it was loaded from a file), and it dies with its parent (`PR_SET_PDEATHSIG`),
so a killed run leaves no rule function spinning. State a function keeps in its module
lives in the child, and starts afresh after a timeout.

The calls of one `run` go over in one message; the child answers call by call, and each
answer must come within `timeout_s` of the one before it: the time the call itself took.
A child that dies or hangs mid-call is replaced and the call runs once more in the new one,
so a worker killed from outside (the OOM killer, a test's kill hook) changes no score; a
call that kills or hangs its child twice is the function's failure ("error", "timeout").
Each child has an id (`worker_id`, then a new one per replacement, as the Ray parts have),
the part "rule-reward worker <id>" of the `REPRORL_TEST_KILL` hooks, whose key is "score".
This module imports no torch, so a child starts in a fraction of a second.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from reprorl.errors import ReproRLError

logger = logging.getLogger(__name__)


def call_rule_fn(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> tuple[float, str | None]:
    """`fn(**kwargs)` as (a finite float score, the answer it reports or None). A verl-style
    dict gives its "score" and, when it has one, its "pred" (the response's final answer,
    for validation's majority vote), as a string.

    Raises whatever `fn` raises, and ValueError for NaN or an infinity.
    """
    score, pred = _score_and_pred(fn(**kwargs))
    if not math.isfinite(score):
        raise ValueError(f"reward function returned {score}; expected a finite number")
    return score, pred


def call_batch_fn(fn: Callable[..., Any], kwargs: Mapping[str, Sequence[Any]]
                  ) -> tuple[list[float], list[str | None]]:
    """`fn(**kwargs)` of a batch reward function (lists in, one result per sample out) as
    (finite float scores, reported answers or None), each read as `call_rule_fn` reads one.

    Raises whatever `fn` raises, and ValueError for a result that is not a list of one
    score per sample, or holds NaN or an infinity.
    """
    expected = len(next(iter(kwargs.values())))
    result = fn(**kwargs)
    if not isinstance(result, (list, tuple)) or len(result) != expected:
        got = f"{len(result)} scores" if isinstance(result, (list, tuple)) else f"a {type(result).__name__}"
        raise ValueError(f"batch reward function returned {got}; expected a list of {expected} scores")
    scores, preds = zip(*(_score_and_pred(r) for r in result)) if result else ((), ())
    bad = [i for i, score in enumerate(scores) if not math.isfinite(score)]
    if bad:
        raise ValueError(f"batch reward function returned {scores[bad[0]]} for sample {bad[0]}; expected finite "
                         "numbers")
    return list(scores), list(preds)


def _score_and_pred(result: Any) -> tuple[float, str | None]:
    if not isinstance(result, dict):
        return float(result), None
    pred = result.get("pred")
    return float(result["score"]), None if pred is None else str(pred)


@dataclass(frozen=True)
class Outcome:
    """One call's result: `kind` "ok" (with `score`: a float, a list of them for a batch
    function, and `pred`: the answer(s) the function reported, None where it reported
    none), "error" (with the traceback) or "timeout"."""

    kind: str
    score: float | list[float] = 0.0
    error: str = ""
    pred: str | None | list[str | None] = None


START_TIMEOUT_S = 600.0  # trainer.part_timeout_s's default (not imported: this module stays light)


class RuleWorker:
    """Calls `fn` in a child process, started at the first `run`; `close()` stops it.

    `start_timeout_s`: how long a child may take to load `fn` and say it is ready (its
    imports); past it the child is killed and the start fails naming the limit. With
    `batch`, each call is `call_batch_fn`'s (lists in, a list of scores out), else
    `call_rule_fn`'s. `worker_id`: the first child's id; `next_id`: where a replacement's
    comes from (shared by the workers of one pool, so no two children share an id).
    """

    def __init__(
        self, fn: Callable[..., Any], start_timeout_s: float = START_TIMEOUT_S, *, batch: bool = False,
        worker_id: int = 0, next_id: Callable[[], int] | None = None,
    ) -> None:
        self._payload = cloudpickle.dumps((fn, batch))
        self.start_timeout_s = start_timeout_s
        self.worker_id = worker_id
        self._next_id = next_id or itertools.count(worker_id + 1).__next__
        self._started = False
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None

    def run(self, calls: Sequence[Mapping[str, Any]], timeout_s: float, *, stop_at_timeout: bool) -> list[Outcome]:
        """One `Outcome` per call of `calls` (keyword dicts), in order.

        A child that gives no answer within `timeout_s` seconds, or dies mid-call, is
        killed and replaced, and the call runs again in the new one. Failing twice, the
        call is a "timeout" (with `stop_at_timeout` the outcomes end there) or an "error"
        (a crash, `os._exit`), and a new child takes the calls after it.
        """
        outcomes: list[Outcome] = []
        retried = -1  # the call that already failed once
        while len(outcomes) < len(calls):
            conn = self._start()
            conn.send(list(calls[len(outcomes):]))
            while len(outcomes) < len(calls):
                if not conn.poll(timeout_s):
                    self.close()
                    if self._retry(len(outcomes), retried, f"hung (no answer within {timeout_s:g} s)"):
                        retried = len(outcomes)
                        break
                    outcomes.append(Outcome("timeout"))
                    if stop_at_timeout:
                        return outcomes
                    break
                try:
                    kind, value = conn.recv()
                except EOFError:
                    code = self.close()
                    if self._retry(len(outcomes), retried, f"died (exit code {code})"):
                        retried = len(outcomes)
                        break
                    outcomes.append(Outcome("error", error=f"the rule-reward process died (exit code {code})"))
                    break
                if kind == "ok":  # (score, pred), as call_rule_fn / call_batch_fn give them
                    outcomes.append(Outcome("ok", score=value[0], pred=value[1]))
                else:
                    outcomes.append(Outcome("error", error=value))
        return outcomes

    def _retry(self, call: int, retried: int, how: str) -> bool:
        """Whether call `call` runs again after its child `how` (once: not if it is `retried`)."""
        if call == retried:
            return False
        logger.warning("rule-reward worker %d %s on call %d; a new one runs the call again", self.worker_id, how,
                       call)
        return True

    @property
    def pid(self) -> int | None:
        """The child's process id while one runs."""
        return None if self._proc is None else self._proc.pid

    def close(self) -> int | None:
        """Kill the child, if any, and return its exit code."""
        code = None
        if self._proc is not None:
            self._proc.kill()
            code = self._proc.wait()
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None
        return code

    def _start(self) -> Connection:
        if self._proc is not None and self._proc.poll() is None:
            return self._conn
        self.close()  # a child that died between runs (the OOM killer, say) is replaced
        if self._started:
            self.worker_id = self._next_id()
        self._started = True
        ours, theirs = Pipe()
        # The parent's sys.path, so the child imports what the caller can (the package, tests).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        code = (f"from reprorl.reward.rule_worker import serve; "
                f"serve({theirs.fileno()}, {os.getpid()}, {self.worker_id})")
        self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self._conn = ours
        try:
            ours.send_bytes(self._payload)
            if not ours.poll(self.start_timeout_s):
                self.close()
                raise ReproRLError(f"the rule-reward process did not load the reward function within "
                                   f"{self.start_timeout_s:g} s (trainer.part_timeout_s); it was stopped")
            kind, value = ours.recv()
        except (EOFError, OSError):
            kind, value = "exit", f"it exited with code {self.close()} (its output is above)"
        if kind != "ready":
            self.close()
            raise ReproRLError(f"the rule-reward process could not load the reward function: {value}")
        return ours


def serve(fd: int, parent_pid: int, worker_id: int = 0) -> None:
    """The child's loop: load the function, then answer each batch of calls call by call."""
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the line above
        return
    conn = Connection(fd)
    try:
        fn, batch = cloudpickle.loads(conn.recv_bytes())
        call = call_batch_fn if batch else call_rule_fn
    except Exception:  # noqa: BLE001 - said to the parent, which raises it
        conn.send(("load_error", traceback.format_exc(limit=-3)))
        return
    conn.send(("ready", None))
    kill_switch = _kill_switch(worker_id)
    while True:
        try:
            calls = conn.recv()
        except EOFError:  # the parent closed the pipe
            return
        for kwargs in calls:
            if kill_switch is not None:
                kill_switch.see("score")
            try:
                conn.send(("ok", call(fn, kwargs)))
            except Exception:  # noqa: BLE001 - any failure of user code: the parent counts it
                conn.send(("error", traceback.format_exc()))


def _kill_switch(worker_id: int) -> Any:
    """The test hooks' `KillSwitch` of this child, or None; imported only when a hook is set
    (the supervision module imports Ray, which a child does not otherwise need)."""
    if not (os.environ.get("REPRORL_TEST_KILL") or os.environ.get("REPRORL_TEST_HANG")):
        return None
    from reprorl.actors.supervision import KillSwitch

    return KillSwitch.from_env(f"rule-reward worker {worker_id}")


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a no-op elsewhere). Strictly, when
    the parent's thread that started it ends: the reward loop runs in the main thread."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
