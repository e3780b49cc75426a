"""A rule reward for the trainer's time-limit test: it answers the 4 calls of step 1
(2 prompts x n=2) and never returns from the first call of step 2. The count lives in the
rule-reward process, which keeps the function between steps."""

import time

CALLS = 0


def hang_at_step_2(data_source, solution_str, ground_truth, extra_info=None):
    global CALLS
    CALLS += 1
    while CALLS > 4:
        time.sleep(1)
    return float(len(solution_str) % 3)
