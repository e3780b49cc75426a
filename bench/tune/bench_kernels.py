"""bench/kernels.py's CPU helpers, for the tuning tools beside this file.

A tool run as `python bench/tune/x.py` has bench/tune/ on sys.path, not bench/, so this
loads bench/kernels.py from its path (sys.path stays as Python set it) and hands on what
the tools time with: the same bench linears and the same alternating timer as the
kernel benchmark's CPU tables.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("bench_kernels_main", Path(__file__).resolve().parents[1] / "kernels.py")
_kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_kernels)

cpu_linear_shapes = _kernels.cpu_linear_shapes
cpu_times_ms = _kernels.cpu_times_ms
