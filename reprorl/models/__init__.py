"""Model definitions shared by the engine and the trainer, HF checkpoint I/O, tiny models."""
