"""Every Triton launch in reprorl passes the pinned compiler options (`reprorl.kernels.gpu.launch`):
a launch left on Triton's defaults would change bits with Triton's version (FP fusion's default
is to turn off in 3.10) or with TRITON_DEFAULT_FP_FUSION. Read from the source, so it holds on a
machine without a GPU."""

import ast
from pathlib import Path

import reprorl

ROOT = Path(reprorl.__file__).parent


def launches(tree: ast.AST):
    """The calls `name[grid](...)` in a module that imports triton: a jitted kernel's launch,
    whatever the kernel's name (a launcher may take the kernel as an argument)."""
    imports_triton = any(isinstance(node, (ast.Import, ast.ImportFrom))
                         and any((alias.name if isinstance(node, ast.Import) else node.module or "").startswith("triton")
                                 for alias in node.names)
                         for node in ast.walk(tree))
    if not imports_triton:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name):
            yield node


def test_every_triton_launch_passes_the_pinned_options():
    found, unpinned = 0, []
    for path in sorted(ROOT.rglob("*.py")):
        for call in launches(ast.parse(path.read_text())):
            found += 1
            if not any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == "PINNED" for k in call.keywords):
                unpinned.append(f"{path.relative_to(ROOT)}:{call.lineno} {call.func.value.id}")
    assert found >= 18, f"only {found} launches found: has the launch syntax changed?"
    assert not unpinned, "launches without **PINNED: " + ", ".join(unpinned)
