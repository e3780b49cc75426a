"""The rule-reward child's start: a child that never says it is ready (an import that
hangs) is killed at `start_timeout_s` instead of stalling the run."""

import os
import sys
import time

import pytest

from reprorl.errors import ReproRLError
from reprorl.reward.rule_worker import RuleWorker

# The child is any process but this one (not `sys.argv[0] == "-c"`: pytest-xdist's workers
# are `python -c` processes too, and the test's own import would hang).
HANGS_IN_CHILD = '''import os, time
if os.getpid() != {test_pid}:  # the rule-reward child: its import never ends
    time.sleep(3600)

def score(**kwargs):
    return 1.0
'''


def test_a_child_that_never_loads_the_function_is_stopped_at_the_limit(tmp_path, monkeypatch):
    (tmp_path / "hangs_in_child.py").write_text(HANGS_IN_CHILD.format(test_pid=os.getpid()))
    monkeypatch.syspath_prepend(str(tmp_path))  # importable here and in the child: pickled by reference
    from hangs_in_child import score

    worker = RuleWorker(score, start_timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(ReproRLError, match=r"^the rule-reward process did not load the reward function within 2 s "
                                           r"\(trainer.part_timeout_s\); it was stopped$"):
        worker.run([{}], timeout_s=30.0, stop_at_timeout=True)
    assert time.monotonic() - t0 < 20 and worker.pid is None
    sys.modules.pop("hangs_in_child", None)
