"""The CPU extension's loader: a finished build is imported directly, without torch's
`cpp_extension` (which imports setuptools and runs ninja in every rank and replica), and only
where `load` would do nothing; in every other case `load` runs as before."""

import os
import subprocess
import sys
import time

import pytest

from reprorl.kernels import build


@pytest.mark.parametrize("root", [None, "set"])
def test_build_directory_is_torchs(root, tmp_path, monkeypatch):
    from torch.utils.cpp_extension import _get_build_directory

    if root is None:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        name = build.extension().__name__  # an existing build: torch's function makes the folder
    else:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
        name = "some_extension"
    assert str(build.build_directory(name)) == _get_build_directory(name, verbose=False)


def _inputs():
    return [build.CSRC / name for name in build._SOURCES + build._HEADERS]


def test_a_finished_build_loads_without_cpp_extension():
    build.extension()  # the build exists from here on
    code = ("import sys; from reprorl.kernels.build import extension; m = extension(); "
            "print(hasattr(m, 'mm_nt'), 'torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


def test_the_loader_defers_to_load_where_a_build_is_due(tmp_path, monkeypatch):
    name = build.extension().__name__
    assert build._built_module(name, _inputs()) is not None  # finished, no lock, nothing newer
    assert build._built_module("reprorl_never_built", _inputs()) is None  # no library

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = build.build_directory("fake")
    directory.mkdir(parents=True)
    library = directory / "fake.so"
    library.write_bytes(b"")  # never imported: each case below stops before
    source = tmp_path / "source.cpp"
    source.write_text("")
    os.utime(library, (time.time() - 60, time.time() - 60))
    assert build._built_module("fake", [source]) is None  # a source newer than the library
    os.utime(library)
    (directory / "lock").write_text("")
    assert build._built_module("fake", [source]) is None  # a build under way
