"""Data-parallel worker groups whose results do not depend on the number of workers.

- `group.WorkerGroup`: the actor, reference or critic as N Ray actor processes; the fit
  loop's one way to reach a model.
- `worker.ShardWorker`: one rank (a model, its shard of the optimizer state).
- `flat`: the flat shard layout and the fixed-order reductions (why N does not change a bit).
"""
