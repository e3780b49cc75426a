"""The trainer: actor/reference and critic workers, checkpoints, the fit loop.

- `policy.PolicyWorker`: the actor (trainable) or the reference (frozen) policy.
- `critic.CriticWorker`: the PPO value model.
- `checkpoint`: atomic checkpoints of a run and RNG capture/restore.
- `optim`: AdamW, the learning-rate schedule and the guarded optimizer step.

Nothing is imported here, so `import reprorl.trainer.checkpoint` stays light.
"""
