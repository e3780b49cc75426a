"""When a Ray actor of the run dies: the run's restart budget and the replacement of one actor.

A sample depends only on (weights, prompt ids, sampling params, request seed), a reward
score only on its pair, and an agent loop's requests only on its plan (docs/design.md). So a
dead rollout replica, reward-model replica or agent-loop worker can be replaced and its
work redone elsewhere without changing a bit of the run, provided the replacement serves
the same weight version and runs in the same determinism mode. The pools and the
agent-loop manager do that with the pieces here:

- `Restarts`: the run's budget, `trainer.max_restarts` replacements over all parts; one
  more raises `FaultError` naming the part, so a process that keeps dying stops the run.
- `time_limit`, `PartTimeoutError`: how long a call may take (`trainer.part_timeout_s`,
  scaled by the tokens it carries); a part past it is hung, and treated as dead: killed,
  and replaced like a dead one (its work redone elsewhere has the same bits).
- `gather`: wait for calls to several actors, setting apart the ones whose actor died
  or did not answer within the limit.
- `replace_dead`: for each dead actor of a pool, charge the budget, start a replacement
  (a new actor with a new id), bring it up to date, check its determinism info against
  the pool's first one, swap it in, log.
- `KillSwitch`: a test hook that SIGKILLs (or SIGSTOPs: a hang) a named part at a fixed
  point of the run.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError

from reprorl.errors import ReproRLError

logger = logging.getLogger(__name__)

K = TypeVar("K")

# The part kinds that can be replaced, and the metric counting their replacements per step.
RESTART_METRICS = {
    "rollout replica": "rollout/replica_restarts",
    "reward replica": "reward/replica_restarts",
    "agent-loop worker": "agent_loop/worker_restarts",
    "load balancer": "agent_loop/balancer_restarts",
}

# The keys of a part's determinism info that `determinism_report.find_problems` reads: a
# replacement equal to the pool's first part on these gets the same verdict.
MODE_KEYS = ("backend", "batch_invariant", "num_threads", "dtype", "deterministic_algorithms", "env", "max_num_seqs")

PART_TIMEOUT_S = 600.0  # trainer.part_timeout_s's default
TOKENS_PER_LIMIT = 1_000_000  # a call carrying more tokens gets proportionally longer


def time_limit(part_timeout_s: float, tokens: int = 0) -> float:
    """Seconds a call may take: `part_timeout_s`, times tokens / `TOKENS_PER_LIMIT` past a million.

    `tokens`: what the call carries (a rollout: rows x (prompt + response budget); an
    update: its batch's tokens x epochs); 0 for a call of fixed size (a start, a push, a probe).

    >>> time_limit(600.0), time_limit(600.0, 4_000_000)
    (600.0, 2400.0)
    """
    return part_timeout_s * max(1.0, tokens / TOKENS_PER_LIMIT)


class PartTimeoutError(ReproRLError, TimeoutError):
    """A part did not answer a call within its limit (`time_limit`): it is hung, and
    treated as dead (killed; replaced where parts are replaced)."""


class FaultError(ReproRLError, RuntimeError):
    """A part of the run died and the run cannot go on with the same bits: no replacement
    is left in `trainer.max_restarts`, or the replacement did not start, serve the current
    weights or run in the first one's determinism mode. The message names the part."""


class Restarts:
    """The run's budget of replacements: at most `max_restarts` in all, over every pool.

    The trainer makes one per run and gives it to each pool (the agent-loop manager uses
    its rollout pool's); a pool made on its own gets `Restarts(0)`: no replacement. Each
    replacement is charged before it starts; past the limit `charge` raises `FaultError`.
    `pop_metrics` gives the replacements per kind (`RESTART_METRICS`) since its last call.
    Thread-safe: with `trainer.max_staleness` > 0 the rollout pool's replacements are
    charged on the producer's thread while the trainer pops the metrics on its own.
    """

    def __init__(self, max_restarts: int) -> None:
        if max_restarts < 0:
            raise ValueError(f"Restarts: max_restarts={max_restarts}; expected >= 0")
        self.max_restarts = max_restarts
        self.total = 0
        self._since_pop: dict[str, int] = {}  # metric -> replacements since pop_metrics
        self._lock = threading.Lock()

    def watch(self, kind: str) -> None:
        """Report `kind`'s metric (0 until one dies) from now on; its pool calls this once."""
        with self._lock:
            self._since_pop.setdefault(RESTART_METRICS[kind], 0)

    def charge(self, kind: str, dead_id: int, noticed_in: str, how: str = "died") -> None:
        """Count the replacement of `kind dead_id`, found dead in `noticed_in`; log it.
        `how`: "died", or how it hung (e.g. "hung (no answer within 5 s)").

        Raises `FaultError` (naming the part and when) if the budget is used up.
        """
        when = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
        death = f"{kind} {dead_id} {how} (noticed in {noticed_in} at {when})"
        with self._lock:
            if self.total >= self.max_restarts:
                raise FaultError(f"{death} and no replacement is left: trainer.max_restarts={self.max_restarts} "
                                 f"replacements allowed per run, {self.total} made")
            self.total += 1
            metric = RESTART_METRICS[kind]
            self._since_pop[metric] = self._since_pop.get(metric, 0) + 1
        logger.warning("%s; replacing it (replacement %d of %d this run)", death, self.total, self.max_restarts)

    def pop_metrics(self) -> dict[str, float]:
        """{metric: replacements since the last call} for every watched kind; resets them."""
        with self._lock:
            metrics = {k: float(v) for k, v in sorted(self._since_pop.items())}
            self._since_pop = dict.fromkeys(self._since_pop, 0)
        return metrics


def gather(refs: Mapping[K, Any], failures: tuple[type[BaseException], ...] = (RayActorError,),
           timeout_s: float | None = None) -> tuple[dict[K, Any], dict[K, BaseException]]:
    """Wait for every ref of `refs` (key -> ObjectRef); returns (results, failed) by key.

    A ref that raises one of `failures` (by default: its actor died, `RayActorError`) goes
    to `failed` with its error; any other error is raised once every ref has finished.
    A ref with no answer within `timeout_s` (None: no limit) goes to `failed` with a
    `PartTimeoutError`: its part is hung, and the caller treats it as dead.
    """
    pending = []
    if refs:
        _, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    results, failed = {}, {}
    for key, ref in refs.items():
        if ref in pending:
            failed[key] = PartTimeoutError(f"no answer within {timeout_s:g} s")
            continue
        try:
            results[key] = ray.get(ref)
        except failures as err:
            failed[key] = err
    return results, failed


def get_within(ref: Any, timeout_s: float, what: str) -> Any:
    """`ray.get(ref)` within `timeout_s`; past it a `PartTimeoutError` naming `what`."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise PartTimeoutError(f"{what}: no answer within {timeout_s:g} s (trainer.part_timeout_s)") from None


def first_line(err: BaseException) -> str:
    """An error's message cut to its first line (Ray's carry tracebacks), for one-line errors."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def replace_dead(
    actors: dict[int, Any],
    dead: Collection[int] | Mapping[int, BaseException],
    kind: str,
    new_ids: Iterator[int],
    *,
    start: Callable[[int], Any],
    reference_info: Mapping[str, Any],
    restarts: Restarts,
    noticed_in: str,
    bring_up: Callable[[Any], str] | None = None,
    timeout_s: float = PART_TIMEOUT_S,
) -> dict[int, int]:
    """Replace each `dead` id of `actors` (id -> handle, changed in place), in id order, by
    a new actor `kind <next of new_ids>`; returns {dead id: new id}. `dead` may map each
    id to its failure (as `gather` gives it): a `PartTimeoutError` is logged as a hang.

    Per dead actor: charge `restarts` (`FaultError` past the limit), `start(new_id)` (the
    new handle, e.g. after `pool.wait_for_actors`), compare its `determinism_info()` (within
    `timeout_s`) with `reference_info` (the pool's first part) on `MODE_KEYS`, since a
    replacement must run exactly like the part it replaces, then `bring_up(actor)` (e.g.
    load the current weights and check their version; returns a note for the log). Any
    failure kills the new actor and raises `FaultError` naming the part; the dead one
    stays in `actors`. A hung one is killed when replaced (Ray's kill ends a stopped process too).
    """
    replaced = {}
    for dead_id in sorted(dead):
        new_id = next(new_ids)
        err = dead.get(dead_id) if isinstance(dead, Mapping) else None
        how = f"hung ({err})" if isinstance(err, PartTimeoutError) else "died"
        actor = _replace(kind, dead_id, new_id, start=start, reference_info=reference_info, restarts=restarts,
                         noticed_in=noticed_in, bring_up=bring_up, how=how, timeout_s=timeout_s)
        ray.kill(actors.pop(dead_id))
        actors[new_id] = actor
        replaced[dead_id] = new_id
    return replaced


def _replace(kind: str, dead_id: int, new_id: int, *, start: Callable[[int], Any], reference_info: Mapping[str, Any],
             restarts: Restarts, noticed_in: str, bring_up: Callable[[Any], str] | None, how: str,
             timeout_s: float) -> Any:
    restarts.charge(kind, dead_id, noticed_in, how)
    t0 = time.perf_counter()
    actor = None
    try:
        actor = start(new_id)
        info = ray.get(actor.determinism_info.remote(), timeout=timeout_s)
        differ = [f"{key} {info.get(key)!r} (the first had {reference_info.get(key)!r})"
                  for key in MODE_KEYS if info.get(key) != reference_info.get(key)]
        if differ:
            raise RuntimeError("it runs in another determinism mode: " + "; ".join(differ))
        note = bring_up(actor) if bring_up is not None else ""
    except Exception as err:
        if actor is not None:
            ray.kill(actor)
        raise FaultError(f"{kind} {dead_id} {how.split(' (')[0]} and its replacement {kind} {new_id} cannot take over: "
                         f"{first_line(err)}") from err
    logger.warning("%s %d replaces %s %d%s (%.1f s to start and check)", kind, new_id, kind, dead_id,
                   f", {note}" if note else "", time.perf_counter() - t0)
    return actor


KILL_ENV = "REPRORL_TEST_KILL"
"""Test hook, for the fault tests only: `"<part>@<prefix>#<n>"` rules, comma-separated.

The part named (`rollout replica 1`, `reward replica 0`, `agent-loop worker 0`) SIGKILLs
its own process when it sees its n-th request whose key starts with `prefix`: a generate
request's id for replicas and workers (`train/3/` = step 3), `score` for a reward
replica's score calls. A test thereby kills a part at a fixed point mid-step instead of
racing it with a timer. Replacements get new ids, so a rule fires once per run.
"""

HANG_ENV = "REPRORL_TEST_HANG"
"""Test hook, as `KILL_ENV` but the part SIGSTOPs its own process: it hangs, alive and silent."""

_SIGNALS = {KILL_ENV: signal.SIGKILL, HANG_ENV: signal.SIGSTOP}


class KillSwitch:
    """The `KILL_ENV` and `HANG_ENV` rules of one part; `see(key)` on each request. None when none apply."""

    def __init__(self, part: str, rules: list[tuple[str, int]], signals: list[int] | None = None) -> None:
        self.part = part
        self.rules = rules  # (prefix, n)
        self.signals = signals or [signal.SIGKILL] * len(rules)  # what each rule sends
        self.seen = [0] * len(rules)

    @classmethod
    def from_env(cls, part: str) -> KillSwitch | None:
        rules, signals = [], []
        for env, sig in _SIGNALS.items():
            for rule in filter(None, (r.strip() for r in os.environ.get(env, "").split(","))):
                name, _, trigger = rule.partition("@")
                prefix, _, n = trigger.rpartition("#")
                if not n.isdigit() or int(n) < 1:
                    raise ValueError(f"{env}: rule {rule!r}; expected '<part>@<prefix>#<n>', n >= 1")
                if name == part:
                    rules.append((prefix, int(n)))
                    signals.append(sig)
        return cls(part, rules, signals) if rules else None

    def see(self, key: str) -> None:
        for i, (prefix, n) in enumerate(self.rules):
            if key.startswith(prefix):
                self.seen[i] += 1
                if self.seen[i] == n:
                    os.kill(os.getpid(), self.signals[i])


def kill_switch_env() -> dict[str, str]:
    """`{KILL_ENV or HANG_ENV: its value}` for those this process has set, else {}: merged into
    the actors' runtime_env, since Ray's workers do not see variables set after Ray started."""
    return {env: os.environ[env] for env in _SIGNALS if os.environ.get(env)}
