"""workers/ is the layer below trainer/ (reprorl/workers/__init__.py says why): no module
of it imports reprorl.trainer, at its top or inside a function."""

import ast
from pathlib import Path

import reprorl.workers


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def test_no_worker_module_imports_the_trainer():
    package = Path(reprorl.workers.__file__).parent
    found = {path.name: sorted(m for m in imported_modules(path) if m.startswith("reprorl.trainer"))
             for path in sorted(package.glob("*.py"))}
    assert len(found) >= 8  # the package's modules were read
    assert {name: mods for name, mods in found.items() if mods} == {}
