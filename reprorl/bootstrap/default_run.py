"""The embedded default run's assets: the synthetic task and the warm-started tiny policy,
and the GPU example's larger policy (examples/gpu_arithmetic.yaml, `GPU_POLICY_PATH`).

`reprorl train` with the default config needs a model and data that no hub provides, so
the project makes them, deterministically from fixed seeds, the first time they are
missing, and reuses them after. They are made only when the config points at their
default paths: a user's own path that does not exist stays an error.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from reprorl.config import Config
from reprorl.determinism import CUBLAS_WORKSPACE_CONFIG

logger = logging.getLogger(__name__)

# Fixed seeds: the assets are part of the default job, not of a run; a run's own seed
# (`seed=`) changes its sampling and data order, not the task or the starting model.
DATA_SEED = 0
MODEL_SEED = 0
# The synthetic task: sums and differences of operands up to 20 (arithmetic_problems).
NUM_TRAIN_ROWS = 2048
NUM_VAL_ROWS = 128
# The supervised warm start imitates a base model that met the task in running text, where
# one problem follows another: it learns the sums, and after answering it goes on to write
# the next problem RUN_ON_FRACTION of the time. The reward wants the answer alone, then
# stop, so greedy decoding starts near 0 accuracy while most sampled groups hold a right
# answer that stops: what RL teaches in 30 steps is to stop after the answer (it does not
# teach a 128-wide model arithmetic that fast). See the README's default run.
WARM_START_STEPS = 1500
WARM_START_BATCH_SIZE = 32
WARM_START_LR = 1e-3
RUN_ON_FRACTION = 0.7

# The GPU example's policy: the tiny model's tokenizer and task, ~75M parameters (width
# 768, 12 layers, 12 query heads on 4 KV heads, tied embeddings), warm-started on the GPU
# (bf16 autocast, float32 weights) with the same run-on pairs. A minute or less on an H200.
GPU_POLICY_PATH = "models/gpu-policy"
GPU_MODEL_SHAPE = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                   "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64}
GPU_WARM_START_STEPS = 1200
GPU_WARM_START_BATCH_SIZE = 64
GPU_WARM_START_LR = 3e-4

# The code example's assets (examples/code.yaml): the project's code task and a tiny policy
# made from a seed, not warm-started: it will rarely write a program that passes, which is
# fine, since the example is there to run the sandboxed reward path and show its bits repeat.
CODE_DATA_DIR = "data/code"
CODE_POLICY_PATH = "models/tiny-code-policy"


def prepare_default_assets(cfg: Config) -> None:
    """Make the default data and model if `cfg` uses their default paths and they are missing."""
    defaults = Config()
    data_files = [*cfg.data.train_files, *cfg.data.val_files]
    if cfg.data.train_files == defaults.data.train_files and cfg.data.val_files == defaults.data.val_files:
        if not all(Path(p).exists() for p in data_files):
            make_default_data(Path(cfg.data.train_files[0]).parent)
    if cfg.model.path == defaults.model.path and not Path(cfg.model.path).exists():
        make_default_policy(Path(cfg.model.path), Path(cfg.data.train_files[0]))
    if cfg.model.path == GPU_POLICY_PATH and not Path(cfg.model.path).exists():
        make_gpu_policy(Path(cfg.model.path), Path(cfg.data.train_files[0]))
    code_files = [f"{CODE_DATA_DIR}/train.parquet", f"{CODE_DATA_DIR}/val.parquet"]
    if data_files == code_files and not all(Path(p).exists() for p in data_files):
        from reprorl.data.code_tasks import write_code_dataset

        logger.info("making the code task's data in %s", CODE_DATA_DIR)
        write_code_dataset(CODE_DATA_DIR, seed=DATA_SEED)
    if cfg.model.path == CODE_POLICY_PATH and not Path(cfg.model.path).exists():
        from reprorl.models.tiny import make_tiny

        logger.info("making the code example's tiny policy in %s", CODE_POLICY_PATH)
        make_tiny(Path(CODE_POLICY_PATH), kind="policy", seed=MODEL_SEED)


def make_default_data(out_dir: Path) -> dict[str, Path]:
    from reprorl.data.synthetic import write_arithmetic_dataset

    logger.info("making the default task's data in %s", out_dir)
    return write_arithmetic_dataset(out_dir, num_train=NUM_TRAIN_ROWS, num_val=NUM_VAL_ROWS, seed=DATA_SEED)


def make_default_policy(out_dir: Path, train_file: Path) -> Path:
    """A tiny policy warm-started on the train split's (prompt, answer) pairs."""
    from reprorl.data.dataset import read_rows
    from reprorl.models.tiny import make_tiny
    from reprorl.bootstrap.warm_start import warm_start

    logger.info("making the default policy in %s (tiny model + %d warm-start steps)", out_dir, WARM_START_STEPS)
    pairs = run_on_pairs(read_rows(train_file), RUN_ON_FRACTION, seed=MODEL_SEED)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as scratch:
        base = make_tiny(Path(scratch) / "base", kind="policy", seed=MODEL_SEED)
        warm_start(
            base, out_dir, pairs, steps=WARM_START_STEPS, batch_size=WARM_START_BATCH_SIZE,
            lr=WARM_START_LR, seed=MODEL_SEED, batch_invariant=True,
        )
    return out_dir


def run_on_pairs(rows: list[dict], run_on_fraction: float, seed: int) -> list[tuple[list[dict], str]]:
    """Warm-start (prompt messages, target) pairs from task rows, some running on.

    Each row's target is its answer; with probability `run_on_fraction` (a seeded draw
    per row) the answer is followed by a newline and another row's problem and answer,
    as in text where problems follow one another. A pure function of the arguments.

    >>> rows = [{"prompt": [{"role": "user", "content": f"{a}+1="}],
    ...          "reward_model": {"ground_truth": str(a + 1)}} for a in range(3)]
    >>> [target for _, target in run_on_pairs(rows, 0.0, seed=0)]
    ['1', '2', '3']
    >>> [target.split("\\n")[0] for _, target in run_on_pairs(rows, 1.0, seed=0)]
    ['1', '2', '3']
    """
    import torch

    if not 0.0 <= run_on_fraction <= 1.0:
        raise ValueError(f"run_on_fraction={run_on_fraction!r}: expected a number in [0, 1]")
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for row in rows:
        target = row["reward_model"]["ground_truth"]
        # Both draws happen for every row, so a row's target does not depend on the
        # fraction's effect on the rows before it.
        run_on = float(torch.rand((), generator=generator)) < run_on_fraction
        other = rows[int(torch.randint(len(rows), (), generator=generator))]
        if run_on:
            target += "\n" + other["prompt"][-1]["content"] + other["reward_model"]["ground_truth"]
        pairs.append((row["prompt"], target))
    return pairs


def make_gpu_policy(out_dir: Path, train_file: Path, *, shape: dict[str, int] | None = None,
                    steps: int = GPU_WARM_START_STEPS) -> Path:
    """The GPU example's policy (`GPU_MODEL_SHAPE` unless `shape` overrides fields), warm-
    started on CUDA for `steps` on the train split's run-on pairs, as the default policy."""
    import dataclasses

    import torch

    from reprorl.data.dataset import read_rows
    from reprorl.errors import ConfigError
    from reprorl.models.hf_io import save_model
    from reprorl.models.tiny import init_weights, tiny_args
    from reprorl.models.tokenizer import make_char_tokenizer
    from reprorl.models.transformer import CausalLM
    from reprorl.bootstrap.warm_start import warm_start

    if not torch.cuda.is_available():  # (asks the driver; does not start CUDA)
        raise ConfigError(f"model.path={str(out_dir)!r}: the GPU example's policy is made on a GPU, and torch sees "
                          "none here; run examples/gpu_arithmetic.yaml on a machine with CUDA")
    # This process starts CUDA here, before the run: cuBLAS reads its workspace setting only
    # then, and full determinism (enable_full_determinism, later in this process) needs it.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    args = dataclasses.replace(tiny_args("policy"), **{**GPU_MODEL_SHAPE, **(shape or {})})
    logger.info("making the GPU policy in %s (%s + %d warm-start steps on cuda)", out_dir, args, steps)
    pairs = run_on_pairs(read_rows(train_file), RUN_ON_FRACTION, seed=MODEL_SEED)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as scratch:
        model = CausalLM(args)
        init_weights(model, MODEL_SEED)
        base = save_model(model, args, Path(scratch) / "base")
        make_char_tokenizer().save_pretrained(base)
        warm_start(base, out_dir, pairs, steps=steps, batch_size=GPU_WARM_START_BATCH_SIZE, lr=GPU_WARM_START_LR,
                   seed=MODEL_SEED, device="cuda")
    torch.cuda.empty_cache()  # the run's workers and replicas need the memory, not this process
    return out_dir
