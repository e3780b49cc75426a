"""What the default run needs before it can train: its synthetic data and warm-started tiny
policy (`default_run`), made by the supervised warm start (`warm_start`, an SFT loop)."""
