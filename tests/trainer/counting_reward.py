"""A reward for trainer tests that records each call: one line in the file named by
REPRORL_TEST_CALLS_FILE (a file, so calls made in another process count too)."""

import os


def count_calls(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["REPRORL_TEST_CALLS_FILE"], "a", encoding="utf-8") as f:
        f.write(f"{data_source}\n")
    return 1.0
