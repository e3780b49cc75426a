"""A rule reward for the time-limit tests: a response starting with "hang" never returns,
"boom" raises, anything else scores its length."""

import time


def hang_or_length(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.startswith("hang"):
        while True:
            time.sleep(1)
    if solution_str == "boom":
        raise ValueError("boom")
    return float(len(solution_str))
