"""`on_kernels(model, invariant)`: run a block with a model on the CPU's batch-invariant
kernels (or stock torch), restoring the model's own backend afterwards."""

from contextlib import contextmanager

from reprorl.kernels import select_kernels


@contextmanager
def on_kernels(model, invariant: bool = True):
    previous = model.kernels
    model.kernels = select_kernels("cpu", invariant)
    try:
        yield model.kernels
    finally:
        model.kernels = previous
