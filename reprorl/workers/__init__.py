"""The training ranks: the actor, reference and critic models and everything that trains them.

- `group.WorkerGroup`: the actor, reference or critic as N ranks (Ray actor processes, or
  one rank in the caller's process for tests); the fit loop's one way to reach a model.
- `worker.ShardWorker`: one rank. It loads the model and owns it, its shard of the
  float32 master weights and AdamW state, and the one training loop (`update`).
- `policy`, `critic`: the models' math as plain functions of a model and a micro-batch:
  loading, log-probs, values and the per-micro-batch losses. No optimizer, no update loop.
- `micro_batches`: how a batch is cut into micro-batches (sample count or token budget).
- `optim`: AdamW, the learning-rate schedule, the chunked optimizer step.
- `flat`, `grad_tree`: the flat shard layout and the fixed-order reductions (why N
  workers give one worker's bits).

Layering: this package is below `trainer/` (the fit loop, checkpoints, placement), which
imports it; nothing here imports `reprorl.trainer`. The losses and the optimizer live here,
beside the rank that runs them, because a rank is the only thing that trains a model:
one training path, whatever the number of ranks.
"""
