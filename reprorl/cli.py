"""The `reprorl` command.

Each subcommand parses its own arguments here and calls one function of the part that
does the work; modules are imported lazily so `reprorl --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys

from reprorl.errors import ReproRLError


def _split_config_args(items: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] [key=value ...]`: the first item is the file when it has no `=`."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _cmd_config(args: argparse.Namespace) -> int:
    from reprorl.config import config_to_yaml, load_config

    path, overrides = _split_config_args(args.args)
    cfg = load_config(path, overrides)
    if not args.memory:
        print(config_to_yaml(cfg), end="")
        return 0
    from reprorl.resources.memory import GIB, gpu_total_bytes, memory_report
    from reprorl.resources.placement import resolve_device

    gpu_total = args.gpu_gib * GIB if args.gpu_gib else (
        gpu_total_bytes() if resolve_device(cfg.resources.device) == "cuda" else None)
    print(memory_report(cfg, gpu_total))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from reprorl.config import load_config
    from reprorl.determinism import pin_cpu_kernels
    from reprorl.bootstrap.default_run import prepare_default_assets
    from reprorl.trainer.fit import train

    path, overrides = _split_config_args(args.args)
    cfg = load_config(path, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if cfg.full_determinism:
        pin_cpu_kernels()  # before the default assets: their bytes are part of the run
    prepare_default_assets(cfg)
    run_dir = train(cfg)
    print(f"run directory: {run_dir}")
    return 0


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from reprorl.determinism import pin_cpu_kernels
    from reprorl.models.tiny import make_tiny

    pin_cpu_kernels()  # the weights drawn from a seed: the same bytes on any x86-64 CPU
    out = make_tiny(args.out_dir, kind=args.kind, seed=args.seed, family=args.family)
    print(f"wrote tiny {args.family} {args.kind} model to {out}")
    return 0


def _cmd_make_data(args: argparse.Namespace) -> int:
    from reprorl.data.synthetic import write_arithmetic_dataset

    paths = write_arithmetic_dataset(
        args.out_dir, num_train=args.num_train, num_val=args.num_val, seed=args.seed, fmt=args.format
    )
    for split, path in paths.items():
        print(f"wrote {split} split to {path}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from reprorl.compare import compare_main

    return compare_main(args.run_a, args.run_b, plot=args.plot)


def _cmd_export(args: argparse.Namespace) -> int:
    from reprorl.export import export

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    out = export(args.run_dir, args.out_dir, step=args.step, merged=args.merged, base=args.base)
    print(f"exported to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reprorl",
        description="Reinforcement-learning post-training of language models, reproducible bit for bit.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("train", help="train: with no arguments, the embedded default run (GRPO on a tiny model)")
    p.add_argument(
        "args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
        help="a YAML config file (optional), then overrides such as trainer.total_steps=10",
    )
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("config", help="print the resolved config (defaults, YAML file, key=value overrides)")
    p.add_argument(
        "args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
        help="a YAML config file (optional), then overrides such as rollout.temperature=0.7",
    )
    p.add_argument("--memory", action="store_true",
                   help="print the run's GPU memory estimate per part instead (reads the models' config.json only)")
    p.add_argument("--gpu-gib", type=float, default=None,
                   help="with --memory: the GPU's size in GiB (default: this machine's GPU, if it has one)")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("make-tiny", help="write a tiny HF-format model directory made from a seed")
    p.add_argument("out_dir", help="directory to write (created if absent; its model files are overwritten)")
    p.add_argument("--kind", choices=["policy", "reward"], default="policy", help="causal LM or reward model")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights; the same seed writes the same bytes")
    p.add_argument("--family", default="qwen2",
                   help="the model family (config.json model_type) at the tiny shape: qwen2 (default), qwen3, "
                        "llama, mistral, olmo2, phi3 or gemma3_text")
    p.set_defaults(func=_cmd_make_tiny)

    p = sub.add_parser("make-data", help="write the synthetic arithmetic task in verl's dataset schema")
    p.add_argument("out_dir", help="directory to write train and validation files into")
    p.add_argument("--num-train", type=int, default=2048, help="rows in the train split")
    p.add_argument("--num-val", type=int, default=256, help="rows in the validation split")
    p.add_argument("--seed", type=int, default=0, help="seed of the problems; the same seed writes the same rows")
    p.add_argument("--format", choices=["parquet", "jsonl"], default="parquet", help="file format")
    p.set_defaults(func=_cmd_make_data)
    p = sub.add_parser("compare", help="compare two runs step by step, bit for bit; print the first divergence")
    p.add_argument("run_a", help="a run directory (holds fingerprints.jsonl)")
    p.add_argument("run_b", help="the run directory to compare with run_a")
    p.add_argument(
        "--plot", default=None, metavar="PATH.png",
        help="also draw both runs' reward/mean and val/accuracy curves, overlaid, into this PNG (none without it)",
    )
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("export", help="write a run's policy as an HF model directory, or its LoRA adapters for PEFT")
    p.add_argument("run_dir", help="the run directory (its checkpoints/)")
    p.add_argument("out_dir", help="the directory to write (created if absent)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step; default: the newest intact one")
    p.add_argument("--merged", action="store_true",
                   help="LoRA runs: merge the adapters into the base weights and write a full HF model")
    p.add_argument("--base", default=None,
                   help="the base model directory, if not at the run's model.path as seen from here")
    p.set_defaults(func=_cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except ReproRLError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
