"""The package's floors: each part of reprorl (a subpackage, or a module at the top) has a
floor, and a module imports only its own part and the parts on lower floors. Parts that
share a floor are siblings and never import each other (a sideways import). Every import
counts, at module level and inside functions (read with `ast`, nothing is imported).

Where today's code breaks the order, the import is listed in KNOWN with the item of issue 54
that removes it: the test fails on a new one, and on a listed one that is gone (strike it
from the list then)."""

import ast
import functools
from pathlib import Path

import reprorl

PACKAGE = Path(reprorl.__file__).parent

# Bottom to top: the floor order of the package, written once.
FLOORS = (
    ("reprorl", "errors", "io"),  # "reprorl": the package's own __init__ (its version)
    ("kernels",),  # every op of a forward pass; the C++ extension; the pinned host math
    ("determinism",),  # hashing, seeds, the environment; pins the kernels' host math
    ("sandbox",),  # untrusted programs, isolated: below data, whose code rewards run them
    ("algos", "data", "determinism_report", "fingerprint", "protocol"),
    ("models",),
    ("actors",),  # what every actor shares: supervision, the replica pool, the weight transport
    ("rollout", "reward", "workers"),  # the Ray actors: engine replicas, reward models, trainer ranks
    ("agent_loop",),  # drives the rollout pool
    ("config",),  # validates against the tools' names, the algos' table and the models' LoRA targets
    ("bootstrap", "records", "resources"),  # the default run's assets; checkpoints and records; placement, memory
    ("trainer",),
    ("compare", "export"),  # read a run's records
    ("cli",),
)
FLOOR = {part: i for i, parts in enumerate(FLOORS) for part in parts}

# (importing module, imported module) -> what removes it.
KNOWN: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """The reprorl modules `path` imports anywhere in it; `from a import b` is module a.b when b
    is one, else a."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base)
    return {name for name in found if name == "reprorl" or name.startswith("reprorl.")}


def _part(module: str) -> str:
    names = module.split(".")
    return names[1] if len(names) > 1 else "reprorl"


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@functools.cache
def _violations() -> dict[tuple[str, str], str]:
    """(importing module, imported module) -> why it breaks the order."""
    found = {}
    for path in _sources():
        importer = _module_name(path)
        for imported in _imports(path):
            mine, theirs = _part(importer), _part(imported)
            if mine == theirs or FLOOR[theirs] < FLOOR[mine]:
                continue
            how = "sideways" if FLOOR[theirs] == FLOOR[mine] else "upward"
            found[(importer, imported)] = f"{how}: {mine} (floor {FLOOR[mine]}) imports {theirs} ({FLOOR[theirs]})"
    return found


def test_every_part_has_one_floor():
    parts = {_part(_module_name(path)) for path in _sources()}
    listed = [part for floor in FLOORS for part in floor]
    assert len(listed) == len(set(listed)), "a part is on two floors"
    assert parts == set(listed), f"unplaced: {sorted(parts - set(listed))}; gone: {sorted(set(listed) - parts)}"


def test_imports_follow_the_floors():
    found = _violations()
    new = {pair: why for pair, why in found.items() if pair not in KNOWN}
    assert not new, "imports against the floor order (tests/test_layers.py FLOORS):\n" + "\n".join(
        f"  {a} -> {b}: {why}" for (a, b), why in sorted(new.items()))


def test_the_known_exceptions_are_still_true():
    gone = sorted(set(KNOWN) - set(_violations()))
    assert not gone, f"no longer imported (strike them from KNOWN): {gone}"


def test_imports_inside_functions_are_read():
    """workers/group.py imports the rollout pool inside a method: the walk sees it."""
    assert "reprorl.actors.pool" in _imports(PACKAGE / "workers" / "group.py")
