"""reprorl: reinforcement-learning post-training of language models, reproducible bit for bit."""

__version__ = "0.1.0"
