"""A reward for trainer tests that varies between samples of an untrained model.

A random tiny policy never solves the arithmetic task, so its rule reward is always 0 and
every advantage is 0: nothing would train. This one scores the share of digits in the
response, which differs from sample to sample.
"""


def digit_share(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)


def short_answer(data_source, solution_str, ground_truth, extra_info=None):
    """A second varied reward (the weighted-rewards recipe): higher for shorter responses."""
    return 1.0 / (1 + len(solution_str))


def odd_answers_only(data_source, solution_str, ground_truth, extra_info=None):
    """Dynamic sampling's reward (algorithm.filter_groups): `digit_share` for a prompt whose
    answer is odd, 0 for the others, whose groups then never vary and are dropped."""
    return digit_share(data_source, solution_str, ground_truth) if int(ground_truth) % 2 else 0.0


def digit_share_and_answer(data_source, solution_str, ground_truth, extra_info=None):
    """`digit_share`, and the response's first character as its answer (verl's "pred"):
    few values, so a prompt's samples share answers and validation has a majority to take."""
    return {"score": digit_share(data_source, solution_str, ground_truth), "pred": solution_str[:1] or None}
