"""Where two CPUs part: the default policy's warm start, step by step and op by op.

    python bench/cpu_bits.py --out amd.json              # on one machine
    python bench/cpu_bits.py --out xeon.json             # on another (same torch build)
    python bench/cpu_bits.py --compare amd.json xeon.json

A run records, with full determinism's pinned CPU kernels:
- the digests of torch's CPU transcendentals (exp, log, sin, ...) over 2^20 arguments, and
  the C library's version (they are its functions in torch's portable build);
- every kernel call's output of the first warm-start step's forward, in call order;
- every module's output, every parameter's gradient and the loss of the first warm-start
  step (digests, in module order, from forward and backward hooks);
- the loss of every step of the warm start the default run makes (its data, base model,
  schedule and batch order), as exact hex floats, and a digest of the parameters after
  each step;
- every kernel call of the CPU engine sampling a few prompts from the model the warm start
  left, and the responses' tokens and log-probs.
`--compare` names the first step whose loss differs and, if the first step already does,
the first op whose output differs: where to look when the default run's bits differ
between machines. `--steps N` stops the per-step record after N steps (the schedule stays
the default run's, so the steps recorded are the same ones).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from reprorl.determinism import ATEN_CPU_CAPABILITY

os.environ.setdefault("ATEN_CPU_CAPABILITY", ATEN_CPU_CAPABILITY)  # before torch starts, as `reprorl train`

import torch  # noqa: E402


def record(steps: int | None, ops_at: int = 1) -> dict:
    from transformers import AutoTokenizer

    from reprorl.data.dataset import read_rows
    from reprorl.determinism import pin_cpu_kernels, tensor_digest
    from reprorl.models.hf_io import load_model
    from reprorl.models.tiny import make_tiny
    from reprorl.bootstrap import default_run
    from reprorl.bootstrap.warm_start import collate, sft_example, sft_loss

    pin_cpu_kernels()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        default_run.make_default_data(root / "data")
        pairs = default_run.run_on_pairs(read_rows(root / "data" / "train.parquet"), default_run.RUN_ON_FRACTION,
                                         seed=default_run.MODEL_SEED)
        base = make_tiny(root / "base", kind="policy", seed=default_run.MODEL_SEED)
        tokenizer = AutoTokenizer.from_pretrained(base)
        examples = [sft_example(tokenizer, messages, answer) for messages, answer in pairs]
        model, _ = load_model(base, kind="causal_lm")
        params: list[list[str]] = []
        if ops_at > 1:  # the steps before, then the parameters they left
            warm_start_steps(model, examples, tokenizer.pad_token_id, stop_after=ops_at - 1)
            params = [[f"param {name}", tensor_digest(p.detach())] for name, p in model.named_parameters()]

        from reprorl.kernels import select_kernels

        kernel_ops: list[list[str]] = []
        model.kernels = _Recording(select_kernels("cpu", batch_invariant=True), kernel_ops)
        ops = step_ops(model, examples, tokenizer.pad_token_id, collate, sft_loss, tensor_digest, ops_at)
        ops[:0] = params + kernel_ops  # the kernels' calls of the forward first: finer than the modules
        model, _ = load_model(base, kind="causal_lm")  # the warm start from the same base
        step_params: list[str] = []
        losses = warm_start_steps(model, examples, tokenizer.pad_token_id, stop_after=steps, params_out=step_params)
        rollout = rollout_ops(model, examples, tokenizer, tensor_digest)
    return {"machine": platform.processor() or platform.machine(), "cpu": _cpu_name(), "torch": torch.__version__,
            "libc": " ".join(platform.libc_ver()), "threads": torch.get_num_threads(), "ops_at": ops_at, "ops": ops,
            "functions": function_digests(tensor_digest), "losses": [float(x).hex() for x in losses],
            "params": step_params, "rollout": rollout}


def warm_start_steps(model, examples, pad_token_id, stop_after: int | None, params_out: list | None = None) -> list:
    """The default run's warm start (its schedule, batches and settings), stopped after
    `stop_after` steps; each step's loss. `params_out` gets one digest of all parameters
    after each step (the optimizer step wrapped), to find the first step they part."""
    from unittest import mock

    from reprorl.determinism import stable_digest, tensor_digest
    from reprorl.bootstrap import default_run, warm_start

    def step_and_record(optimizer, params, *args, **kwargs):
        norm = original(optimizer, params, *args, **kwargs)
        if params_out is not None:
            params_out.append(stable_digest(*(tensor_digest(p.detach()) for p in params)))
        return norm

    original = warm_start.guarded_step
    with mock.patch.object(warm_start, "guarded_step", step_and_record):
        return warm_start.sft_train(model, examples, steps=default_run.WARM_START_STEPS,
                                    batch_size=default_run.WARM_START_BATCH_SIZE, lr=default_run.WARM_START_LR,
                                    seed=default_run.MODEL_SEED, pad_token_id=pad_token_id, batch_invariant=True,
                                    log_every=0, stop_after=stop_after)


def rollout_ops(model, examples, tokenizer, digest, prompts: int = 8, max_tokens: int = 12) -> list[list[str]]:
    """Every kernel call of the CPU engine (batch-invariant, as the default run's replicas)
    sampling `prompts` of the warm start's prompts from the model the warm start left, in
    call order, then each response's tokens and log-probs: where the default run's first
    rollout parts when the warm-started weights are equal."""
    import asyncio

    from reprorl.rollout.engine import Engine
    from reprorl.rollout.request import SamplingParams

    ops: list[list[str]] = []
    engine = Engine(model, batch_invariant=True, eos_token_id=tokenizer.eos_token_id, max_num_seqs=prompts)
    engine.kernels = model.kernels = _Recording(engine.kernels, ops)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    asks = [ids[: mask.index(1)] for ids, mask in examples[:prompts]]

    async def sample() -> list:
        return await asyncio.gather(*(engine.generate(f"r{i}", ids, params, seed=i) for i, ids in enumerate(asks)))

    try:
        outs = asyncio.run(sample())
    finally:
        engine.shutdown()
    for i, out in enumerate(outs):
        ops.append([f"response {i} tokens", digest(torch.tensor(out.token_ids))])
        ops.append([f"response {i} log-probs", digest(torch.tensor(out.log_probs, dtype=torch.float64))])
    return ops


class _Recording:
    """A kernel backend whose every call's output is appended to `ops` as [name, digest]."""

    def __init__(self, kernels, ops: list[list[str]]):
        self._kernels, self._ops = kernels, ops

    def __getattr__(self, name):
        from reprorl.determinism import tensor_digest

        fn = getattr(self._kernels, name)
        if not callable(fn):
            return fn

        def recorded(*args, **kwargs):
            out = fn(*args, **kwargs)
            first = out[0] if isinstance(out, tuple) else out
            self._ops.append([f"kernel {name} {len(self._ops)}", _digest(first, tensor_digest)])
            return out

        return recorded


def function_digests(digest) -> dict[str, str]:
    """Digests of torch's CPU transcendentals over 2^20 float32 arguments: which library
    function's bits differ between two machines (exp, log, ... are the C library's in
    torch's portable build)."""
    x = torch.linspace(-30.0, 30.0, 1 << 20, dtype=torch.float32)
    positive = torch.linspace(1e-6, 1e3, 1 << 20, dtype=torch.float32)
    cases = {"exp": lambda: torch.exp(x), "log": lambda: torch.log(positive), "sin": lambda: torch.sin(x),
             "cos": lambda: torch.cos(x), "tanh": lambda: torch.tanh(x), "sigmoid": lambda: torch.sigmoid(x),
             "silu": lambda: torch.nn.functional.silu(x), "softmax": lambda: torch.softmax(x.view(1024, -1), -1),
             "log_softmax": lambda: torch.log_softmax(x.view(1024, -1), -1),
             "rsqrt": lambda: torch.rsqrt(positive), "pow": lambda: torch.pow(positive, 0.37),
             "sqrt": lambda: torch.sqrt(positive), "div": lambda: positive / 1.0009995,
             "lerp": lambda: positive.lerp(x, 0.1), "addcmul": lambda: positive.addcmul(x, x, value=0.001),
             "addcdiv": lambda: x.addcdiv(x.flip(0), positive, value=-3e-4), "square": lambda: x.square(),
             "row_sum": lambda: x.view(256, -1).sum(-1), "cumsum64": lambda: x.double().cumsum(0)}
    return {name: digest(fn()) for name, fn in cases.items()}


def step_ops(model, examples, pad_token_id, collate, sft_loss, digest, step: int) -> list[list[str]]:
    """[name, digest] of every module's output, the loss and every gradient, for the batch
    of warm-start step `step` (1-based)."""
    from reprorl.bootstrap import default_run
    from reprorl.bootstrap.warm_start import batch_indices

    ops: list[list[str]] = []
    hooks = [m.register_forward_hook(lambda m, i, out, name=name: ops.append([f"forward {name}", _digest(out, digest)]))
             for name, m in model.named_modules() if name]
    indices = batch_indices(len(examples), default_run.WARM_START_BATCH_SIZE, step, default_run.MODEL_SEED)[step - 1]
    input_ids, attention_mask, loss_mask = collate([examples[i] for i in indices], pad_token_id)
    loss = sft_loss(model(input_ids, attention_mask), input_ids, loss_mask)
    ops.append(["loss", digest(loss.detach())])
    loss.backward()
    for h in hooks:
        h.remove()
    ops.extend([f"grad {name}", digest(p.grad)] for name, p in model.named_parameters() if p.grad is not None)
    return ops


def _digest(out, digest) -> str:
    return digest(out.detach()) if isinstance(out, torch.Tensor) else digest(torch.zeros(0))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    print(f"a: {a['cpu']}, torch {a['torch']}, {a['threads']} threads\nb: {b['cpu']}, torch {b['torch']}, "
          f"{b['threads']} threads")
    print(f"C library: {a.get('libc')} vs {b.get('libc')}")
    differ = [name for name in a.get("functions", {}) if a["functions"][name] != b.get("functions", {}).get(name)]
    print("torch's CPU transcendentals that differ: " + (", ".join(differ) or "none"))
    op = next(((x, y) for x, y in zip(a["ops"], b["ops"]) if x != y), None)
    print(f"step {a.get('ops_at', 1)}, op by op: " + ("all equal" if op is None else f"first difference at {op[0][0]}"))
    parted = next((i for i, (x, y) in enumerate(zip(a.get("params", []), b.get("params", []))) if x != y), None)
    if "params" in a and "params" in b:
        print("parameters after each step: " + ("all equal" if parted is None else
                                                 f"first differ after step {parted + 1}"))
    rollout = next(((x, y) for x, y in zip(a.get("rollout", []), b.get("rollout", [])) if x != y), None)
    if "rollout" in a and "rollout" in b:
        print("the engine's rollout from the warm-started model: " + ("all equal" if rollout is None else
                                                                      f"first difference at {rollout[0][0]}"))
    step = next((i for i, (x, y) in enumerate(zip(a["losses"], b["losses"])) if x != y), None)
    common = min(len(a["losses"]), len(b["losses"]))
    print(f"losses of {common} steps: " + ("all equal" if step is None else
                                            f"first difference at step {step + 1}: {a['losses'][step]} vs "
                                            f"{b['losses'][step]}"))
    return 0 if op is None and step is None and parted is None and rollout is None else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="JSON file to write")
    p.add_argument("--steps", type=int, default=None, help="record only the first N warm-start steps")
    p.add_argument("--ops-at", type=int, default=1, help="record op by op at this warm-start step (1-based), "
                   "after the parameters the steps before it left")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="compare two records")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("--out or --compare is needed")
    result = record(args.steps, args.ops_at)
    Path(args.out).write_text(json.dumps(result) + "\n")
    print(f"{result['cpu']}: {len(result['ops'])} ops, {len(result['losses'])} steps -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
