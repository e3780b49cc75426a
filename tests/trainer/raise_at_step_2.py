"""A rule reward for the trainer's error-rate test: it scores the 4 calls of step 1
(2 prompts x n=2) and raises from step 2 on. The count lives in the rule-reward process,
which keeps the function between steps."""

CALLS = 0


def raise_at_step_2(data_source, solution_str, ground_truth, extra_info=None):
    global CALLS
    CALLS += 1
    if CALLS > 4:
        raise KeyError("no answer key for this sample")
    return float(len(solution_str) % 3)
