"""Parse TOML and CLI overrides into ``JobConfig``, rejecting anything unknown.

Every error is a ``ConfigError`` whose message is one line naming the key
(``[section] key``) and the problem, so ``run_train.sh`` can print it and exit
with code 2 before any worker starts.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import tomli

from .job_config import JobConfig


class ConfigError(ValueError):
    """A configuration problem; the message names the key."""


def _require(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}")


def one_line_errors(main, *args) -> int:
    """Run a script's ``main(*args)``; a ``ConfigError`` ends it in one line (``config error: ...``, exit 2)
    instead of a traceback."""
    import sys

    try:
        return main(*args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if _is_optional(tp):
        return f"{_type_name(_strip_optional(tp))} (or omitted)"
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _is_optional(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp)


def _strip_optional(tp: Any) -> Any:
    rest = tuple(a for a in get_args(tp) if a is not type(None))
    return rest[0] if len(rest) == 1 else Union[rest]


def _coerce(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """Check ``value`` against the field type; CLI strings are parsed first."""
    if _is_optional(tp):
        if from_cli and isinstance(value, str) and value.lower() in ("none", "null", ""):
            return None
        tp = _strip_optional(tp)
    bad = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if _is_union(tp):  # e.g. Literal["auto"] | int: the first member that takes the value, in order
        for member in get_args(tp):
            try:
                return _coerce(key, value, member, from_cli)
            except ConfigError:
                pass
        raise bad
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if tp is bool:
        if from_cli and isinstance(value, str):
            if value.lower() in ("true", "1", "yes"):
                return True
            if value.lower() in ("false", "0", "no"):
                return False
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    if get_origin(tp) is list:
        (item_tp,) = get_args(tp)
        if from_cli and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad
        return [_coerce(f"{key}[{i}]", v, item_tp, from_cli) for i, v in enumerate(value)]
    raise ConfigError(f"{key}: unsupported field type {tp}")


RENAMED = {("rollout_engine", "engine_workers"): "gpus_per_engine", ("sglang_engine", "engine_workers"): "gpus_per_engine"}
"""Keys that changed name (one concept, one name): refused naming the new one."""


def _fields(section_obj: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(type(section_obj))
    return {f.name: hints[f.name] for f in dataclasses.fields(section_obj)}


def _set(cfg: JobConfig, section: str, key: str, value: Any, from_cli: bool) -> None:
    sections = _fields(cfg)
    if section not in sections:
        raise ConfigError(f"unknown section [{section}]; known: {', '.join(sections)}")
    section_obj = getattr(cfg, section)
    keys = _fields(section_obj)
    if (section, key) in RENAMED:
        raise ConfigError(f"[{section}] {key} is now {RENAMED[section, key]} (same meaning): rename it")
    if key not in keys:
        raise ConfigError(f"[{section}] unknown key {key!r}; known: {', '.join(keys)}")
    setattr(section_obj, key, _coerce(f"[{section}] {key}", value, keys[key], from_cli))


def parse_overrides(argv: list[str]) -> list[tuple[str, str, str]]:
    """``--section.key=value`` or ``--section.key value`` into (section, key, value)."""
    out = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"override {arg!r}: expected --section.key=value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"override --{name}: missing value")
            value = argv[i + 1]
            i += 1
        section, _, key = name.partition(".")
        out.append((section, key, value))
        i += 1
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file, then CLI overrides; unknown names are errors."""
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = tomli.loads(path.read_text())
        except tomli.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"top-level key {section!r} must be a [section] table")
            for key, value in table.items():
                if isinstance(value, dict):
                    raise ConfigError(f"[{section}] {key}: nested tables are not supported")
                _set(cfg, section, key, value, from_cli=False)
    for section, key, value in parse_overrides(overrides or []):
        _set(cfg, section, key, value, from_cli=True)
    for section, key in _PATH_KEYS:  # the shell does not expand "~" inside --key=~/x or a TOML string
        table = getattr(cfg, section)
        setattr(table, key, os.path.expanduser(getattr(table, key)))
    return cfg


# Keys that hold a file or folder path: "~" is the user's home in them, not a folder named "~".
_PATH_KEYS = (("job", "dump_folder"), ("model", "hf_assets_path"), ("checkpoint", "initial_load_path"),
              ("data", "path"), ("data", "chat_template"), ("rl", "rollout_dir"), ("rollout_engine", "python"),
              ("rollout_engine", "weights_dir"), ("sglang_engine", "python"), ("sglang_engine", "weights_dir"))


def to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)
