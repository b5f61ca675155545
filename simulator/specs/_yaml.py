"""Strict YAML reading.

PyYAML, left to itself, lets a duplicate key silently overwrite the first one and reads ``989e12`` as the
*string* ``'989e12'`` (YAML 1.1 floats need a dot). Both turn a typo into a silently wrong simulation, so
this loader rejects duplicate keys with both line numbers, and the field readers in :mod:`._fields` reject
numbers written as strings. Files are read once, when a spec is built; nothing here is on a hot path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from simulator.errors import SpecError, not_utf8

__all__ = ["MAX_SPEC_BYTES", "load_yaml_file", "load_yaml_text", "read_spec_bytes"]


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader whose mappings refuse duplicate keys."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if not isinstance(key_node, yaml.ScalarNode):
            kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
            raise SpecError(f"line {line}", f"a key is a {kind} (a '? ' complex key)", "write keys as plain names")
        if key in seen:
            raise SpecError(
                f"line {line}",
                f"duplicate key {key!r} (first defined on line {seen[key]})",
                "keep one of them",
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

# Numbers as YAML 1.2 reads them. YAML 1.1, PyYAML's default, reads a leading zero as octal and colons as base 60,
# so `layers: 010` was 8, `1:30` 90 and `1:10.5` 70.5, silently, while `--global-batch 010` means 10. Decimal digits
# are decimal here (leading zeros allowed), 0x/0o/0b prefixed ones hexadecimal, octal and binary; a float is
# PyYAML's pattern without its base-60 form; "1:30" stays a string, which the field readers refuse with the key.
_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)
_StrictLoader.add_implicit_resolver(
    _INT_TAG,
    re.compile(r"^(?:[-+]?[0-9][0-9_]*|[-+]?0x[0-9a-fA-F_]+|[-+]?0o[0-7_]+|[-+]?0b[01_]+)$"),
    list("-+0123456789"),
)


def _construct_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node)).replace("_", "")
    sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
    bases = {"0x": 16, "0o": 8, "0b": 2}
    base = bases.get(digits[:2].lower(), 10)
    return sign * int(digits[2:] if base != 10 else digits, base)


_StrictLoader.add_constructor(_INT_TAG, _construct_int)


def load_yaml_text(text: str, where: str) -> Any:
    """Parse YAML text strictly; errors name ``where`` (usually the file)."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - _StrictLoader is a SafeLoader
    except SpecError as err:
        raise SpecError(f"{where}: {err.where}", err.what, err.fix) from None
    except RecursionError:
        raise SpecError(where, "nested too deeply to read", "flatten the lists and mappings") from None
    except (ValueError, TypeError, AttributeError, OverflowError) as err:
        # A scalar its tag cannot build: a date like 2001-13-45, '!!int abc', an integer of thousands of digits.
        what = "an integer of more than 4,300 digits" if "digits" in str(err) else str(err)
        raise SpecError(where, f"holds a value YAML cannot read ({what})", "write a plain number or string") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError(f"{where}: {at}", f"not valid YAML ({problem})", "fix the syntax") from None


# The most a spec file (model, cluster, calibration YAML, or config.json) may hold: the largest shipped table is
# under 1 MiB, and /dev/zero or a stray multi-GiB file named by mistake would otherwise be read into memory whole.
MAX_SPEC_BYTES = 64 * 2**20


def read_spec_bytes(
    path: Path, limit: int = MAX_SPEC_BYTES, too_big: tuple[str, str] = ("far more than a spec file", "check the path")
) -> bytes:
    """The bytes of a spec file, at most ``limit`` (OSError as reading raises it); a longer file is a SpecError
    saying it holds more than ``limit`` MiB, then ``too_big``'s reason, with its fix."""
    with path.open("rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        reason, fix = too_big
        raise SpecError(str(path), f"holds more than {limit // 2**20} MiB, {reason}", fix)
    return data


def load_yaml_file(path: Path) -> Any:
    """Read and parse a YAML file strictly."""
    try:
        data = read_spec_bytes(path)
    except FileNotFoundError:
        raise SpecError(str(path), "file not found", "check the path") from None
    except IsADirectoryError:
        raise SpecError(str(path), "is a directory, not a file", "name a YAML file") from None
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the name, which no file system takes
        raise SpecError(
            str(path).replace("\x00", "\\x00"), f"cannot be read ({err.__class__.__name__}: {err})", "check the path"
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(str(path), not_utf8(data), "save the file as UTF-8") from None
    return load_yaml_text(text, str(path))
