"""Where a run's parts go and whether they fit: `placement` (each part's device and GPU
share), `memory` (the GPU memory a run needs, estimated from the models' config.json)."""
