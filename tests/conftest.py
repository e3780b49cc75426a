"""Shared fixtures: the project's tokenizer and per-test scratch directories."""

import pytest

from reprorl.models.tokenizer import make_char_tokenizer


@pytest.fixture(scope="session")
def char_tokenizer():
    """The tiny models' character-level ChatML tokenizer (vocab 128)."""
    return make_char_tokenizer()
