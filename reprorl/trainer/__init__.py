"""The driver of a run: the fit loop and what surrounds it, above the training ranks.

- `fit.Trainer`: runs the step loop and validates, on the parts `parts` builds from the
  config (worker groups, rollout pool, reward loop) and stops; `saving` checkpoints the
  run and resumes it.
- `checkpoint`, `resume_guard`, `run_dir`: atomic checkpoints of a run, RNG capture and
  restore, what a resumed run may change.
- `placement`, `memory`: where each part runs, and whether it fits there.
- `tracking`, `val_metrics`, `weight_sync`, `warm_start`, `default_run`: metrics, the
  weight push to the replicas, the SFT warm start, the default run's assets.

Layering: `trainer/` imports `workers/` (the ranks, their models, losses and optimizer),
never the other way round: a rank needs nothing of the driver, so `workers/` runs and is
tested alone (a group of one rank in the test's process), and the driver reaches a model
only through `workers.group.WorkerGroup`.

Nothing is imported here, so `import reprorl.trainer.checkpoint` stays light.
"""
