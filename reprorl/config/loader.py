"""Loading a config from YAML and `key=value` overrides, and writing it back as YAML.

Loading goes: defaults -> YAML file -> overrides (each value type-checked as it is set, so
errors name the file or the override) -> `derive` (the ONE place where derived values are
filled in, checks.py) -> `validate` (checks that involve several fields). Every problem is a
`ConfigError` with a one-line message that names the key, the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import textwrap
import types
import typing
from typing import Any, Literal

import yaml

from reprorl.config.checks import derive, validate
from reprorl.config.schema import Config, config_fields, config_keys, field_bounds
from reprorl.errors import ConfigError


# ---------------------------------------------------------------------------------------
# YAML: YAML 1.2-style scalars, so `yes`/`no`/`on`/`off` stay strings (a bool field then
# rejects them), `1e-6` is a float, `010` is ten and `1:30` is not ninety.
# ---------------------------------------------------------------------------------------


def _yaml12_resolvers() -> dict[str, list]:
    """PyYAML's implicit resolvers with bool, int, float and timestamp replaced by YAML 1.2's."""
    dropped = ("bool", "int", "float", "timestamp")
    resolvers = {
        first: [(tag, rx) for tag, rx in entries if tag.rsplit(":", 1)[-1] not in dropped]
        for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    number = r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    for tag, pattern, firsts in (
        ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
        ("int", r"[-+]?[0-9]+", "-+0123456789"),
        ("float", rf"{number}|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)", "-+.0123456789"),
    ):
        for first in firsts:
            resolvers.setdefault(first, []).append((f"tag:yaml.org,2002:{tag}", re.compile(f"^(?:{pattern})$")))
    return resolvers


class _Loader(yaml.SafeLoader):
    yaml_implicit_resolvers = _yaml12_resolvers()

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        # PyYAML keeps the last of two equal keys without a word; in a config that hides a mistake.
        seen = set()
        for key_node, _ in node.value:
            if key_node.value in seen:
                problem = f"duplicate key {key_node.value!r}"
                raise yaml.constructor.ConstructorError(None, None, problem, key_node.start_mark)
            seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


_Loader.add_constructor("tag:yaml.org,2002:int", lambda loader, node: int(node.value))  # `010` is ten, not octal


class _Dumper(yaml.SafeDumper):
    # The loader's resolvers, so a string that would read back as a number or bool gets quoted.
    yaml_implicit_resolvers = _Loader.yaml_implicit_resolvers


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is built on SafeConstructor
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML{at}: {problem}") from None


def _yaml_value(value: Any) -> str:
    """One value as a line of YAML that `_Loader` reads back as the same value."""
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, list):  # reward.fns: its items as mappings
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    text = yaml.dump(value, Dumper=_Dumper, default_flow_style=True, width=math.inf, allow_unicode=True)
    return text.removesuffix("\n...\n").strip()  # a bare scalar document ends with `...`


def _show(value: Any) -> str:
    """A value in an error message: strings quoted as Python does, the rest as YAML."""
    return repr(value) if isinstance(value, str) else _yaml_value(value)


# ---------------------------------------------------------------------------------------
# Type and range checks of single values.
# ---------------------------------------------------------------------------------------


def _range_text(bounds: dict[str, float]) -> str:
    """`{"gt": 0, "le": 1}` -> "in (0, 1]"; `{"ge": 0}` -> ">= 0"."""
    lo = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds['gt']}" if "gt" in bounds else None
    hi = f"{bounds['le']}]" if "le" in bounds else f"{bounds['lt']})" if "lt" in bounds else None
    if lo and hi:
        return f"in {lo}, {hi}"
    if lo:
        return (">= " if lo[0] == "[" else "> ") + lo[1:]
    if hi:
        return ("<= " if hi[-1] == "]" else "< ") + hi[:-1]
    return ""


def _describe(tp: Any, bounds: dict[str, float]) -> str:
    """What a field accepts, in words; for error messages and the YAML comments alike."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):  # `X | None`, or `str | list[str]`
        words = " or ".join(_describe(a, bounds) for a in args if a is not type(None))
        return words + (" or null" if type(None) in args else "")
    if tp in (int, float):
        return ("an integer" if tp is int else "a number") + (f" {_range_text(bounds)}" if bounds else "")
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if origin is Literal:
        return "one of " + ", ".join(args)
    if origin is list:
        return "a list of strings" if args[0] is str else f"a list, each {_describe(args[0], {})}"
    if origin is tuple:
        return f"a list of {len(args)} numbers"
    if origin is dict:
        return f"a mapping of names to {_describe(args[1], {})}"
    if dataclasses.is_dataclass(tp):
        return "a mapping of " + ", ".join(config_fields(tp))
    raise TypeError(f"no description for config type {tp!r}")  # a bug in this module, not user input


def _coerce(value: Any, tp: Any, key: str, bounds: dict[str, float]) -> Any:
    """`value` checked against type `tp` and `bounds`; raises ConfigError naming `key`.

    Strict on purpose: an int field refuses 1.5 and true, a bool field refuses 'yes'.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ConfigError(f"{key}: expected {_describe(tp, bounds)}, got {_show(value)}")
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        for inner in (a for a in args if a is not type(None)):  # the first type that takes it
            try:
                return _coerce(value, inner, key, bounds)
            except ConfigError:
                continue
        raise bad
    if tp is bool or tp is str:
        if not isinstance(value, tp):
            raise bad
        return value
    if origin is Literal:
        if value not in args:
            raise bad
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad
        return [_coerce(item, args[0], f"{key}[{i}]", {}) for i, item in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad
        return tuple(_coerce(item, a, f"{key}[{i}]", {}) for i, (item, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(name, str) for name in value):
            raise bad
        return {name: _coerce(item, args[1], f"{key}.{name}", {}) for name, item in value.items()}
    if dataclasses.is_dataclass(tp):  # an item of a list of mappings (reward.fns)
        return _coerce_mapping(value, tp, key)
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):  # bool is an int subclass
        raise bad
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad
        value = float(value)
    if tp not in (int, float):
        raise TypeError(f"unsupported config type {tp!r} for {key}")  # a bug in this module
    if (
        ("ge" in bounds and value < bounds["ge"])
        or ("gt" in bounds and value <= bounds["gt"])
        or ("le" in bounds and value > bounds["le"])
        or ("lt" in bounds and value >= bounds["lt"])
    ):
        raise bad
    return value


def _coerce_mapping(value: Any, tp: type, key: str) -> Any:
    """A `tp` (a config dataclass) from a mapping of its keys, each checked; missing keys keep
    their defaults. An instance (set in Python) is checked key by key the same way."""
    if dataclasses.is_dataclass(value) and isinstance(value, tp):
        value = dataclasses.asdict(value)
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected {_describe(tp, {})}, got {_show(value)}")
    item = tp()
    for name, sub_value in value.items():
        if name not in config_fields(tp):
            raise ConfigError(f"{key}: unknown key {_show(name)}; expected {', '.join(config_fields(tp))}")
        f, sub_tp = config_fields(tp)[name]
        setattr(item, name, _coerce(sub_value, sub_tp, f"{key}.{name}", field_bounds(f)))
    return item


def _check_types(section: Any, prefix: str = "") -> None:
    """Re-check every field's type and range; catches values set in Python, not through `_apply`."""
    for name, (f, tp) in config_fields(type(section)).items():
        value = getattr(section, name)
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, tp):
                raise ConfigError(f"{prefix}{name}: expected a {tp.__name__}, got {value!r}")
            _check_types(value, prefix + name + ".")
        else:
            setattr(section, name, _coerce(value, tp, prefix + name, field_bounds(f)))


# ---------------------------------------------------------------------------------------
# Setting keys: YAML file and overrides go through `_apply`.
# ---------------------------------------------------------------------------------------


def _unknown_key(key: str, source: str | None) -> ConfigError:
    close = difflib.get_close_matches(key, config_keys(), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else " (`reprorl config` prints every key)"
    where = f" in {source!r}" if source else ""
    return ConfigError(f"unknown config key {key!r}{where}{hint}")


def _apply(section: Any, key: str, value: Any, source: str | None, prefix: str = "") -> None:
    """Set dotted `key` of `section` (a config dataclass) to `value`, type-checked.

    A mapping given for a section sets each of its keys. `source` (the YAML file, or None
    for an override) is named in the error messages.
    """
    where = f" (in {source!r})" if source else ""
    name, _, rest = key.partition(".")
    fields = config_fields(type(section))
    if name not in fields:
        raise _unknown_key(prefix + key, source)
    f, tp = fields[name]
    if not dataclasses.is_dataclass(tp):
        if rest:
            raise _unknown_key(prefix + key, source)
        try:
            setattr(section, name, _coerce(value, tp, prefix + name, field_bounds(f)))
        except ConfigError as err:
            raise ConfigError(f"{err}{where}") from None
    elif rest:
        _apply(getattr(section, name), rest, value, source, prefix + name + ".")
    elif value is not None:  # None: an empty section in YAML (`rollout:` with nothing under it)
        if not isinstance(value, dict):
            raise ConfigError(f"{prefix}{name}: expected a mapping of keys, got {_show(value)}{where}")
        for sub_key, sub_value in value.items():
            if not isinstance(sub_key, str):
                raise ConfigError(f"{prefix}{name}: keys must be strings, got {_show(sub_key)}{where}")
            _apply(getattr(section, name), sub_key, sub_value, source, prefix + name + ".")


def _parse_override(text: str) -> tuple[str, Any]:
    key, eq, raw = text.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ConfigError(f"malformed override {text!r} (expected key=value, e.g. rollout.temperature=0.7)")
    return key, _parse_yaml(raw, f"override {text!r}")


# ---------------------------------------------------------------------------------------
# Public entry points.
# ---------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """The config of a run: defaults, then the YAML file at `path` (if any), then `overrides`.

    Each override is `dotted.key=value`, the value a YAML scalar or flow list
    (`rollout.temperature=0.7`, `trainer.loggers=[console,jsonl]`, `model.ref_path=null`).
    Raises ConfigError with a one-line message for any problem.
    """
    overrides = list(overrides or [])
    cfg = Config()
    if path is not None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} not found")
        with open(path, encoding="utf-8") as f:
            raw = _parse_yaml(f.read(), f"config file {path!r}")
        if raw is None:
            raw = {}  # an empty file changes nothing
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path!r}: expected a mapping of sections and keys, got {_show(raw)}")
        for key, value in raw.items():
            if not isinstance(key, str):
                raise ConfigError(f"config file {path!r}: keys must be strings, got {_show(key)}")
            _apply(cfg, key, value, path)
    for text in overrides:
        key, value = _parse_override(text)
        _apply(cfg, key, value, None)
    derive(cfg)
    validate(cfg)
    return cfg


def resolve_config(cfg: Config) -> Config:
    """Check every field of `cfg`, fill in derived values and check cross-field rules (in place).

    `load_config` does this already; call it on a `Config` built or changed in Python.
    """
    _check_types(cfg)
    derive(cfg)
    validate(cfg)
    return cfg


def _yaml_lines(section: Any, indent: str = "") -> list[str]:
    """Each field as `# help` lines, then `name: value  # what it accepts`; sections nest."""
    lines = []
    for name, (f, tp) in config_fields(type(section)).items():
        value = getattr(section, name)
        if dataclasses.is_dataclass(tp) and not indent:
            lines.append("")
        lines.extend(f"{indent}# {line}" for line in textwrap.wrap(f.metadata["help"], width=88 - len(indent) - 2))
        if dataclasses.is_dataclass(tp):
            lines.append(f"{indent}{name}:")
            lines.extend(_yaml_lines(value, indent + "  "))
        else:
            lines.append(f"{indent}{name}: {_yaml_value(value)}  # {_describe(tp, field_bounds(f))}")
    return lines


def config_to_yaml(cfg: Config) -> str:
    """The config as YAML, each field's help (and what it accepts) as a comment above it.

    `load_config` of the result gives an equal Config.
    """
    header = [
        "# reprorl config, fully resolved (derived values filled in).",
        "# Printed by `reprorl config [FILE.yaml] [key=value ...]`; it loads back unchanged.",
    ]
    return "\n".join(header + _yaml_lines(cfg)) + "\n"
