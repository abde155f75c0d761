"""Strict building of typed dataclass configs from plain mappings (parsed YAML or JSON).

Pure Python on purpose: the engine's run configuration and the bridge's own settings
(which live in a host process without torch) are validated by the same rules, so a bad value
fails the same way wherever it is written. Every error names the source, the dotted key path,
the value and what is allowed.

Field constraints ride on dataclass field metadata, built with `spec()`:
`choices`, `min`, `max`, `multiple_of`, `min_len`, `max_len`, `doc`, and `allowed`: what a list field
takes, in words, said of a value that is no list at all, where the type alone would say too little
(`a list of int` says nothing of a step list's order, length or range); a wrong length or item is
still said as such.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

INT64_LIMIT = 1 << 63

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value that is not allowed; the message says where, what and what is allowed."""


def spec(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
         doc: str = "", **constraints: Any) -> Any:
    """A dataclass field with validation constraints and a one-line description."""
    meta = {"doc": doc, **constraints}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def build(cls: type[T], data: Any, *, source: str = "<config>", path: str = "") -> T:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and bad values."""
    where = path or "(top level)"
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: {where}: expected a mapping of keys, got {type(data).__name__} "
                          f"{short_repr(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(f"{source}: {_join(path, str(unknown[0]))}: unknown key{did_you_mean(unknown[0], fields)}; "
                          f"allowed keys here: {', '.join(fields)}")
    values = {}
    for name, value in data.items():
        f = fields[name]
        values[name] = _coerce(hints[name], value, f.metadata, source, _join(path, name))
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {_join(path, str(exc))}") from exc


def did_you_mean(name: Any, allowed: typing.Iterable[str]) -> str:
    """' (did you mean X?)' for the allowed name nearest a mistyped one, or '' when none is near: in a list of
    twenty keys the one meant is easy to miss."""
    near = difflib.get_close_matches(str(name), list(allowed), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _coerce(tp: Any, value: Any, meta: Mapping[str, Any], source: str, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _coerce(a, value, meta, source, path)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[-1]
    if dataclasses.is_dataclass(tp):
        return build(tp, value, source=source, path=path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            _fail(source, path, value, meta.get("allowed") or f"a list of {_name(args[0]) if args else 'values'}")
        _check_len(value, meta, source, path)
        item_meta = {k: v for k, v in meta.items() if k not in ("min_len", "max_len", "allowed")}
        items = [_coerce(args[0], v, item_meta, source, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is typing.Literal:
        if value not in args:
            _fail(source, path, value, "one of " + ", ".join(repr(a) for a in args))
        return value
    return _scalar(tp, value, meta, source, path)


def _scalar(tp: Any, value: Any, meta: Mapping[str, Any], source: str, path: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            _fail(source, path, value, "true or false")
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(source, path, value, "an integer" + _range_text(meta))
        if not -INT64_LIMIT <= value < INT64_LIMIT:  # what torch and numpy take (a seed, say)
            _fail(source, path, value, "an integer of at most 64 bits" + _range_text(meta))
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            _fail(source, path, value, "a finite number" + _range_text(meta))  # NaN fails no comparison
        value = float(value)
    elif tp is str:
        if not isinstance(value, str):  # a choice field names its choices (YAML reads yes/off as booleans)
            _fail(source, path, value, "one of " + ", ".join(repr(c) for c in meta["choices"]) if "choices" in meta
                  else "a string")
        _check_len(value, meta, source, path)
    elif tp is Any:
        return value
    else:
        raise TypeError(f"config field {path} has unsupported type {tp!r}")
    if "choices" in meta and value not in meta["choices"]:
        _fail(source, path, value, "one of " + ", ".join(repr(c) for c in meta["choices"]))
    if "min" in meta and value < meta["min"] or "max" in meta and value > meta["max"]:
        _fail(source, path, value, "a value" + _range_text(meta))
    if "multiple_of" in meta and value % meta["multiple_of"]:
        _fail(source, path, value, f"a multiple of {meta['multiple_of']}")
    return value


def _finite(value: int | float) -> bool:
    """Whether a number is finite as a float: an int past the float range (a YAML or JSON number of 400
    digits) is not, rather than an OverflowError out of `math.isfinite`."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_len(value: Any, meta: Mapping[str, Any], source: str, path: str) -> None:
    lo, hi = meta.get("min_len"), meta.get("max_len")
    if (lo is not None and len(value) < lo) or (hi is not None and len(value) > hi):
        kind, unit = ("a string of", "characters") if isinstance(value, str) else ("a list of", "items")
        count = f"at least {lo}" if hi is None else f"{lo or 0} to {hi}"
        _fail(source, path, value, f"{kind} {count} {unit}")


def _range_text(meta: Mapping[str, Any]) -> str:
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _fail(source: str, path: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{source}: {path}: {short_repr(value)} is not allowed; expected {allowed}")


def short_repr(value: Any, limit: int = 200) -> str:
    """repr() of at most `limit` characters that never walks a whole container: a YAML alias bomb
    expands to gigabytes of text."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 3, limit, limit
    text = r.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def to_dict(obj: Any) -> Any:
    """A dataclass config as plain data (for JSON, YAML and the wire)."""
    return dataclasses.asdict(obj)


def parse_override(text: str) -> tuple[list[str], str]:
    """Split `key.sub=value` into the key path and the raw value text."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected key.sub=value")
    return key.strip().split("."), raw


def apply_override(data: dict, keys: list[str], value: Any) -> None:
    """Set a nested key in a plain mapping, creating intermediate mappings."""
    node = data
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {'.'.join(keys)}: {k} is not a section")
        node = nxt
    if value is None and isinstance(node.get(keys[-1]), dict):  # `--set model=` would reset the whole section
        raise ConfigError(f"--set {'.'.join(keys)}=: {keys[-1]} is a section; set one of its keys "
                          f"({'.'.join(keys)}.KEY=value)")
    node[keys[-1]] = value
