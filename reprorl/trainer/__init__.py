"""The driver of a run: the fit loop, above the training ranks, the replicas and the records.

- `fit.Trainer`: runs the step loop and validates, on the parts `parts` builds from the
  config (worker groups, rollout pool, reward loop) and stops;
- `generation`: a step's batch, rolled out and scored, and a validation; `dynamic_sampling`:
  DAPO's filling of a batch; `async_rollouts`: the batches made ahead with bounded staleness;
- `log_probs`: old, reference log-probs and values, the exact check, the off-policy correction;
- `saving`: a step's checkpoint and the resume (the formats: reprorl/records);
- `checks`, `val_metrics`, `weight_sync`, `run_records`: the start-up checks, validation's
  metrics, the weight push to the replicas, a step's fingerprint and generations log.

Below it: `records/` (checkpoints, the resume guard, the run directory, metrics),
`resources/` (placement, the memory estimate), `bootstrap/` (the default run's assets and
the SFT warm start). `trainer/` imports `workers/` (the ranks), never the other way round.

Nothing is imported here, so `import reprorl.trainer.fit` loads only what it needs.
"""
