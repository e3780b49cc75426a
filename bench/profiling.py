"""What a torch.profiler window spent on the GPU: shared by bench/rollout.py and bench/train_step.py.

`kernel_summary(prof, wall_s, per=steps)`: the window's CUDA kernels by name (top 25 by
time), their groups (linear, attention, sampling, norm/rope/swiglu, other), the kernel time
and the share of the window's wall time the GPU ran any kernel (the union of the kernels'
intervals: the host's gaps between launches are in the window), every time divided by
`per` (a decode step, a micro-batch). `host_summary(prof)`: the top host-side ops by their
own CPU time, which is where a window whose GPU is idle spends it.
"""

from __future__ import annotations

GROUPS = (
    ("sampling", ("_sample_kernel", "softmax", "cumsum", "sort", "argmax", "radix")),
    ("attention", ("attention", "fmha", "flash")),
    ("linear", ("gemm", "nvjet", "cutlass", "matmul", "xmma", "sm90", "splitk")),
    ("norm/rope/swiglu", ("rms", "rotary", "swiglu", "silu")),
)


def kernel_group(name: str) -> str:
    """A kernel's group, by its name: what the profile's groups add up."""
    n = name.lower()
    for group, keys in GROUPS:
        if any(k in n for k in keys):
            return group
    return "other"


def kernel_summary(prof, wall_s: float, per: int = 1, top: int = 25) -> dict:
    from torch.autograd import DeviceType

    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.elapsed_us() > 0]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    busy, end = 0.0, float("-inf")
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in kernels):  # the union of intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    total = sum(sum(v) for v in by_name.values()) or 1e-9
    groups: dict[str, float] = {}
    for name, times in by_name.items():
        groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + sum(times)
    wall_us = wall_s * 1e6
    return {
        "per": per, "wall_ms": round(wall_us / per / 1e3, 3), "kernel_ms": round(total / per / 1e3, 3),
        "gpu_busy": round(busy / wall_us, 3) if wall_us else None,
        "groups_ms": {g: round(t / per / 1e3, 3) for g, t in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": name[:120], "group": kernel_group(name), "calls": len(t) / per,
                         "us": round(sum(t) / per, 1), "share": round(sum(t) / total, 4)}
                        for name, t in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]],
    }


def host_summary(prof, per: int = 1, top: int = 15) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"op": e.key[:80], "calls": e.count / per, "self_cpu_ms": round(e.self_cpu_time_total / per / 1e3, 3)}
            for e in rows]


def print_summary(title: str, s: dict, host: list[dict] | None = None, lines: int = 20) -> None:
    print(f"\n{title}: {s['wall_ms']} ms wall, kernels {s['kernel_ms']} ms, GPU busy "
          f"{s['gpu_busy']:.0%}; by group (ms): " + ", ".join(f"{g} {t}" for g, t in s["groups_ms"].items()))
    for k in s["top_kernels"][:lines]:
        print(f"  {k['us']:10.1f} us  {k['share']:6.1%}  x{k['calls']:<6g} {k['group']:16} {k['name'][:90]}")
    for h in host or []:
        print(f"  host {h['self_cpu_ms']:9.3f} ms  x{h['calls']:<6g} {h['op']}")
