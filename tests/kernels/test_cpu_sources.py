"""Every TORCH_CHECK in the CPU extension (reprorl/kernels/csrc/cpu_*.cpp, cpu_kernels.h) has one
literal message: on the GPU machine (torch 2.11+cu130, g++ 13.3) a failing check whose
message is formatted (several arguments, joined into a std::string) segfaulted in any
extension built there, while a literal one raised RuntimeError. Read from the source."""

import re
from pathlib import Path

import reprorl

SOURCES = sorted((Path(reprorl.__file__).parent / "kernels" / "csrc").glob("cpu_*.[ch]*"))
LITERAL = re.compile(r'^\s*("([^"\\]|\\.)*"\s*)+$')  # "..." (adjacent literals join)


def checks(text: str):
    """(line, arguments) of each TORCH_CHECK(...) call, split at its top-level commas."""
    for match in re.finditer(r"\bTORCH_CHECK\(", text):
        depth, args, current, i, in_string = 1, [], "", match.end(), False
        while depth:
            c = text[i]
            if in_string:
                in_string = not (c == '"' and text[i - 1] != "\\")
            elif c == '"':
                in_string = True
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            elif c == "," and depth == 1:
                args.append(current)
                current = ""
                i += 1
                continue
            if depth:
                current += c
            i += 1
        yield text.count("\n", 0, match.start()) + 1, args + [current]


def formatted(text: str) -> list[int]:
    return [line for line, args in checks(text) if len(args) != 2 or not LITERAL.match(args[1])]


def test_the_scan_finds_a_formatted_message():
    sample = 'TORCH_CHECK(a.dim() == 3, "ok, fine");\nTORCH_CHECK(f(a, b) > 0, "rows: ", n, " expected");\n'
    assert [len(args) for _, args in checks(sample)] == [2, 4]
    assert formatted(sample) == [2]


def test_every_cpu_extension_check_has_a_literal_message():
    found = {path.name: len(list(checks(path.read_text()))) for path in SOURCES}
    assert sum(found.values()) >= 10, f"only {found} checks found: has the check syntax changed?"
    bad = [f"{path.name}:{line}" for path in SOURCES for line in formatted(path.read_text())]
    assert not bad, "TORCH_CHECKs with a formatted message (check in Python and name the values there): " + ", ".join(bad)
