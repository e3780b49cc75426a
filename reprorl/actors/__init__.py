"""What every Ray actor of a run shares, below the parts that are actors (rollout/,
reward/, workers/), so none of them imports another: supervision (`supervision`: the
budget of replacements, gathering with time-outs, replacing a dead actor, the test kill
hooks), the replica pool (`pool`: Ray's start, a pool of replicas with their runtime
environment and CPU shares), and the weight transport (`weights`: packed host buffers
and CUDA IPC shares)."""
