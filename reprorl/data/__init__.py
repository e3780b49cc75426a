"""Datasets in verl's schema, their serving order, rule rewards and the synthetic task."""

from reprorl.data.dataset import PromptDataset, PromptRow, PromptSampler, read_rows, stable_permutation
from reprorl.data.rewards import REWARD_FNS, compute_score
from reprorl.data.synthetic import make_arithmetic_rows, write_arithmetic_dataset

__all__ = [
    "PromptDataset",
    "PromptRow",
    "PromptSampler",
    "REWARD_FNS",
    "compute_score",
    "make_arithmetic_rows",
    "read_rows",
    "stable_permutation",
    "write_arithmetic_dataset",
]
