"""The order prompts are served in: a pure function of (seed, epoch), resumable."""

import json
import random
from itertools import islice

import numpy as np
import pytest

from reprorl.data.dataset import PromptSampler, stable_permutation
from reprorl.errors import ConfigError, DataError


def test_stable_permutation_is_pinned():
    # Pins numpy's SeedSequence + PCG64 raw stream: if this changes, every run's data
    # order changes with it, so a numpy upgrade that breaks it must be noticed.
    assert stable_permutation(8, 0, 0).tolist() == [3, 2, 1, 6, 0, 7, 4, 5]
    assert stable_permutation(8, 0, 1).tolist() == [7, 4, 5, 1, 6, 2, 0, 3]
    assert stable_permutation(8, 1, 0).tolist() == [2, 4, 7, 5, 0, 6, 3, 1]


def test_stable_permutation_is_a_permutation():
    for n in (0, 1, 2, 17, 1000):
        perm = stable_permutation(n, 5, 3)
        assert perm.dtype == np.int64 and sorted(perm.tolist()) == list(range(n))


def test_unshuffled_batches_by_hand():
    s = PromptSampler(10, 4, seed=0, shuffle=False, drop_last=True)
    assert s.batches_per_epoch == 2
    assert list(islice(s, 5)) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    s = PromptSampler(10, 4, seed=0, shuffle=False, drop_last=False)
    assert s.batches_per_epoch == 3
    assert list(islice(s, 4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]


def test_shuffled_epochs_follow_the_epoch_permutation():
    s = PromptSampler(10, 3, seed=7, drop_last=True)
    batches = list(islice(s, 6))  # 3 batches per epoch, the last row of each epoch dropped
    for epoch in range(2):
        order = stable_permutation(10, 7, epoch).tolist()
        assert batches[3 * epoch : 3 * epoch + 3] == [order[0:3], order[3:6], order[6:9]]
    assert batches[:3] != batches[3:]
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["offset"] == 0


def test_full_epoch_covers_every_row_once():
    s = PromptSampler(12, 4, seed=3)
    epoch0 = [i for b in islice(s, 3) for i in b]
    assert sorted(epoch0) == list(range(12))


def test_same_seed_same_batches_regardless_of_global_rng():
    random.seed(1)
    np.random.seed(1)
    a = list(islice(PromptSampler(50, 8, seed=11), 20))
    random.seed(2)
    np.random.seed(2)
    b = list(islice(PromptSampler(50, 8, seed=11), 20))
    c = list(islice(PromptSampler(50, 8, seed=12), 20))
    assert a == b
    assert a != c


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("k", [0, 1, 3, 4, 9])
def test_resume_continues_with_the_same_batches(k, drop_last):
    # 10 rows in batches of 3: k crosses epoch boundaries for k >= 3 (or 4 without drop_last).
    m = 7
    first = PromptSampler(10, 3, seed=5, drop_last=drop_last)
    list(islice(first, k))
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    expected = list(islice(first, m))

    resumed = PromptSampler(10, 3, seed=5, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert list(islice(resumed, m)) == expected


def test_resume_refuses_other_settings():
    state = PromptSampler(10, 3, seed=5).state_dict()
    for kwargs, key in [
        (dict(num_rows=11, batch_size=3, seed=5), "num_rows"),
        (dict(num_rows=10, batch_size=2, seed=5), "batch_size"),
        (dict(num_rows=10, batch_size=3, seed=6), "seed"),
        (dict(num_rows=10, batch_size=3, seed=5, shuffle=False), "shuffle"),
        (dict(num_rows=10, batch_size=3, seed=5, drop_last=False), "drop_last"),
    ]:
        with pytest.raises(ConfigError, match=f"sampler checkpoint has {key}="):
            PromptSampler(**kwargs).load_state_dict(state)


def test_bad_arguments():
    with pytest.raises(DataError, match="the dataset has 3 rows, fewer than one batch of 4"):
        PromptSampler(3, 4, seed=0)
    assert list(islice(PromptSampler(3, 4, seed=0, shuffle=False, drop_last=False), 2)) == [[0, 1, 2], [0, 1, 2]]
    with pytest.raises(ConfigError, match="batch_size=0"):
        PromptSampler(3, 0, seed=0)
    with pytest.raises(ConfigError, match="seed=-1"):
        PromptSampler(3, 1, seed=-1)
