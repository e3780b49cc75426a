"""The training ranks: everything that touches a trainable or frozen model during a run.

- `group.WorkerGroup`: the actor, reference or critic as N ranks (Ray actor processes);
  the fit loop's one way to reach a model.
- `worker.ShardWorker`: one rank: the model, its shard of the float32 master weights and
  AdamW state, and the training loop (`update`).
- `policy`, `critic`: the actor/reference and critic models, their log-probs, values and
  per-micro-batch losses.
- `micro_batches`: how a batch is cut into micro-batches (sample count or token budget).
- `optim`: AdamW, the learning-rate schedule, the chunked optimizer step.
- `flat`, `grad_tree`: the flat shard layout and the fixed-order reductions (why N
  workers give one worker's bits).

Layering: this package is below `trainer/` (the fit loop, checkpoints, placement), which
imports it; nothing here imports `reprorl.trainer`. The losses and the optimizer live here,
beside the rank that runs them, because a rank is the only thing that trains a model:
one training path, whatever the number of ranks.
"""
