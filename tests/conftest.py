"""Shared fixtures: the project's tokenizer and per-test scratch directories."""

import pytest

from reprorl.models.tokenizer import make_char_tokenizer


@pytest.fixture(scope="session")
def char_tokenizer():
    """The tiny models' character-level ChatML tokenizer (vocab 128)."""
    return make_char_tokenizer()


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for one test module, shut down after it if this fixture started it.

    Modules never inherit each other's Ray (its actors, its reserved CPUs), so each runs
    the same alone and in the full suite.
    """
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
