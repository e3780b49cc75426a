"""A rule reward for the trainer's time-limit test: it answers the 4 calls of step 1
(2 prompts x n=2) and never returns from the first call of step 2. The calls are counted
in the file $HANG_AT_STEP_2_CALLS, not in the module: a hung rule-reward process is
replaced and the call runs once more in a fresh one, whose module state starts at zero."""

import os
import time
from pathlib import Path


def hang_at_step_2(data_source, solution_str, ground_truth, extra_info=None):
    counter = Path(os.environ["HANG_AT_STEP_2_CALLS"])
    calls = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(calls))
    while calls > 4:
        time.sleep(1)
    return float(len(solution_str) % 3)
