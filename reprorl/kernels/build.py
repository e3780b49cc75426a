"""The CPU kernels' C++ extension (the sources in `csrc/`), built on first use.

Its own module so that `cpu.py` (the kernels), `cpu_math.py` (their portable math) and
`pinned.py` (that math for the code outside the kernels) all take the extension from below
instead of from each other. The flags here are part of
the bits: no fast-math and no contraction, so every multiply-add is the one written.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch._appdirs  # not imported by `import torch`; cpp_extension's build root comes from it

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
"""Where the extension's C++ sources and headers are."""

# No fast-math and no contraction: every multiply-add in the sources is the one written
# (the bits the kernels promise); every build of them takes these.
_EXACT_CFLAGS = ["-fno-fast-math", "-ffp-contract=off", "-fopenmp"]


ENV_MARCH = "REPRORL_CPU_MARCH"
"""The `-march` the CPU kernels are built for (default `native`); it changes speed, not bits."""


# The extension's files: none includes <torch/extension.h> (cpu_tensor.h says why).
_SOURCES = ("cpu_bindings.cpp", "cpu_matmul.cpp", "cpu_attention.cpp", "cpu_linear.cpp", "cpu_math.cpp",
            "cpu_optim.cpp")
_HEADERS = ("cpu_kernels.h", "cpu_math.h", "cpu_tensor.h")


@functools.cache
def extension():
    """The CPU kernels' C++ extension (matmuls, attention, `cpu_math`'s functions), built on
    first use."""
    sources = [CSRC / name for name in _SOURCES]
    headers = [CSRC / name for name in _HEADERS]
    march = os.environ.get(ENV_MARCH, "native")
    cflags = ["-O3", f"-march={march}", *_EXACT_CFLAGS]
    # One build per checkout, source version and flags: torch rebuilds an extension whose
    # sources moved, so two checkouts (or virtualenvs) sharing one name would rebuild each other's.
    digest = hashlib.sha256(" ".join(cflags).encode())
    for p in sources + headers:
        digest.update(str(p.resolve()).encode() + b"\0" + p.read_bytes())
    name = f"reprorl_cpu_kernels_{digest.hexdigest()[:12]}"
    built = _built_module(name, sources + headers)
    if built is not None:
        return built
    from torch.utils.cpp_extension import load  # here: it imports setuptools, and only a build needs it

    logger.info("building reprorl's CPU kernels (%s, -march=%s), once per machine, about half a minute",
                ", ".join(p.name for p in sources), march)
    try:
        return load(name=name, sources=[str(p) for p in sources], verbose=False, extra_cflags=cflags,
                    extra_ldflags=["-fopenmp"])
    except Exception as e:  # a missing compiler surfaces as several exception types
        raise RuntimeError(
            f"full_determinism on the CPU needs reprorl's kernels ({sources[0].parent}/cpu_*.cpp), built with a C++ "
            f"compiler and ninja (pip install ninja; apt-get install g++); building them failed: {e}"
        ) from e


def build_directory(name: str) -> Path:
    """Where torch's `cpp_extension.load` builds the extension `name` (its
    `_get_build_directory`, without importing that module, which imports setuptools). Were
    another torch to place its builds elsewhere, no library is found here and `load` runs,
    as before: a wrong folder costs the shortcut, never a stale build."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions")),
                            f"{python}_{accelerator}")
    return Path(root) / name


def _built_module(name: str, inputs: list[Path]):
    """The extension `name` imported from its finished build, or None where `load` must run:
    no library yet, a build under way (torch's `lock` file), or an input newer than the
    library (ninja would rebuild it). Each new process (every rank and replica) loads the
    kernels, and `load` costs a setuptools import and a ninja run even when nothing changed
    (0.10 s of a process's CPU and a ninja process, against 0.001 s here)."""
    directory = build_directory(name)
    library = directory / f"{name}.so"
    try:
        built_at = library.stat().st_mtime
        if (directory / "lock").exists() or any(p.stat().st_mtime > built_at for p in inputs):
            return None
    except FileNotFoundError:
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_LINEAR_BINDING = """#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
at::Tensor mm_rows(at::Tensor a, at::Tensor b, std::vector<int64_t> plan);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("mm_rows", &mm_rows); }
"""


def build_linear_variant(name: str, flags: list[str]):
    """`cpu_linear.cpp` alone, built with other compiler flags (other register blocks with
    `-DRL1=..`, another instruction set with `-march=..`), as a module whose `mm_rows(a, b,
    plan)` is `matmul_rows`'s kernel: bench/tune/cpu_blocks.py times blocks with it, and a test
    checks that AVX2 and scalar builds give the native build's bits."""
    from torch.utils.cpp_extension import load

    source = CSRC / "cpu_linear.cpp"
    binding = Path(tempfile.mkdtemp(prefix="reprorl_linear_")) / "binding.cpp"
    binding.write_text(_LINEAR_BINDING)
    headers = b"".join(source.with_name(name).read_bytes() for name in _HEADERS)
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()).hexdigest()[:12]
    march = [] if any(f.startswith("-march=") for f in flags) else ["-march=native"]
    return load(name=f"reprorl_linear_{name}_{digest}", sources=[str(binding), str(source)], verbose=False,
                extra_cflags=["-O3", *march, *_EXACT_CFLAGS, f"-I{source.parent}", *flags], extra_ldflags=["-fopenmp"])
