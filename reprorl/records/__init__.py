"""A run's records on disk: atomic checkpoints and RNG capture (`checkpoint`), what a resume
may change (`resume_guard`), the run directory's lock and history (`run_dir`), metrics and
their sinks and curves (`tracking`). Formats and rules only: saving the parts into them is
the trainer's (reprorl/trainer/saving.py)."""
