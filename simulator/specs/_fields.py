"""Typed, path-tagged reading of a parsed mapping.

A :class:`Fields` wraps one mapping from a YAML file (or a ``config.json``, or CLI overrides) and hands out
typed values. Every failure raises :class:`~simulator.errors.SpecError` naming the file, the key path, the
value, the rule and a fix; :meth:`Fields.done` rejects keys nobody asked for, suggesting the closest known
key. Specs are built through these readers by named constructors (``ModelSpec.from_mapping``), never by
``Spec(**yaml)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import operator
import re
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from simulator.errors import SpecError

__all__ = [
    "MISSING",
    "Fields",
    "check_choices",
    "check_positive",
    "check_ranges",
    "check_scalar_types",
    "did_you_mean",
    "fmt_number",
    "kind_of",
]

T = TypeVar("T")

_NUMBER_TEXT = re.compile(r"^\s*[-+]?(\d[\d_]*)?\.?\d*([eE][-+]?\d+)?\s*$")


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def _squash(name: str) -> str:
    return re.sub(r"[-_.\s]", "", name.lower())


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest choice, or ``""``. A choice that differs only in case and
    separators (``dgxa100`` for ``dgx_a100``) wins; then the choices the word begins (``dgx-a100`` names both
    ``dgx-a100-40g`` and ``dgx-a100-80g``, where spelling distance alone offers ``dgx-v100``), up to three of
    them, for a word of three characters or more; then the closest by spelling."""
    options = list(choices)
    key = _squash(word)
    same = [c for c in options if _squash(c) == key]
    if key and same:
        return f" (did you mean {same[0]!r}?)"
    begun = [c for c in options if _squash(c).startswith(key)] if len(key) >= 3 else []
    if 1 <= len(begun) <= 3:
        return f" (did you mean {' or '.join(repr(c) for c in begun)}?)"
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def is_finite_number(value: Any) -> bool:
    """Whether ``value`` is an int or float (not a bool) that is finite as a float: an integer too large for one
    (YAML and JSON keep every digit) is not."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class Fields:
    """Typed access to one mapping, with the file and key path used in every error.

    Parameters
    ----------
    data : Mapping
        The mapping to read.
    where : str
        The file (or other source) the mapping came from.
    prefix : str
        Key path of this mapping inside the file (``""`` at top level).
    keys : iterable of str
        Every key the reader of this mapping understands. A required key that is missing is matched against
        the file's *other* keys to suggest a rename of a misspelt one; a key listed here is valid in its own
        right (``ffn_hidden`` beside a missing ``hidden``), so it is never offered as that rename.

    Examples
    --------
    >>> f = Fields({"layers": 2}, "m.yaml")
    >>> f.integer("layers", minimum=1)
    2
    """

    def __init__(self, data: Any, where: str, prefix: str = "", keys: Iterable[str] = ()) -> None:
        if not isinstance(data, Mapping):
            raise SpecError(
                self._join(where, prefix),
                f"expected a mapping of keys to values, got {kind_of(data)}",
                "write 'key: value' lines",
            )
        self.data: Mapping[str, Any] = data
        self.where = where
        self.prefix = prefix
        self.keys = frozenset(keys)
        self.used: set[str] = set()

    @staticmethod
    def _join(where: str, path: str) -> str:
        return f"{where}: {path}" if path else where

    def path(self, key: str) -> str:
        """Full key path of ``key`` inside the file."""
        return f"{self.prefix}.{key}" if self.prefix else key

    def at(self, key: str) -> str:
        """``file: key.path`` for error messages."""
        return self._join(self.where, self.path(key))

    def error(self, key: str, what: str, fix: str = "") -> SpecError:
        """A SpecError located at ``key``."""
        return SpecError(self.at(key), what, fix)

    def has(self, key: str) -> bool:
        """Whether the key is present with a non-null value."""
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = MISSING) -> Any:
        """The raw value of ``key``, or ``default`` when absent or null."""
        self.used.add(key)
        value = self.data.get(key)
        if value is None:
            if default is MISSING:
                if key in self.data:  # written, but with no value (``hidden:`` or ``hidden: null``)
                    raise self.error(
                        key, "is required but missing: it is given no value (null)", f"give {key!r} a value"
                    )
                # Only a key nobody reads can be a misspelling of this one (see ``keys``).
                unknown = [str(k) for k in self.data if k not in self.used and str(k) not in self.keys]
                typo = difflib.get_close_matches(key, unknown, 1, 0.75)
                if typo:
                    raise self.error(
                        key, f"is required but missing, and the file has {typo[0]!r}", f"rename {typo[0]!r} to {key!r}"
                    )
                raise self.error(key, "is required but missing", f"add '{key}: ...'")
            return default
        if isinstance(value, np.generic):
            # A what-if grid built with numpy or pandas hands over numpy scalars (np.int64(4096)), which the spec
            # classes take when built directly (check_scalar_types): read as the Python number or flag they hold.
            return value.item()
        return value

    def integer(
        self, key: str, default: Any = MISSING, *, minimum: int | None = None, maximum: int | None = None
    ) -> Any:
        """An integer (``True``/``False`` are refused; ``4.0`` is accepted as 4)."""
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be a whole number, got {_show(value)}", _number_fix(value, key))
        _check_range(self, key, value, minimum, maximum)
        return value

    def number(
        self,
        key: str,
        default: Any = MISSING,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        positive: bool = False,
    ) -> Any:
        """A finite real number (ints accepted)."""
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"must be a number, got {_show(value)}", _number_fix(value, key))
        try:
            value = float(value)
        except OverflowError:  # an integer beyond any float (YAML and --set keep every digit of one)
            raise self.error(key, f"is too large: {fmt_number(value)}", "write a realistic figure") from None
        if not math.isfinite(value):
            raise self.error(key, f"must be finite, got {value}", "write a finite number")
        if positive and value <= 0:
            raise self.error(key, f"must be > 0, got {fmt_number(value)}", "write a positive number")
        _check_range(self, key, value, minimum, maximum)
        return value

    def scaled(self, key: str, value: Any, scale: float, fix: str) -> Any:
        """``value``, read for ``key`` in the unit its name gives, times ``scale`` (to bytes/s, FLOP/s, seconds);
        ``None`` stays ``None``. A number so large that the product overflows to infinity is refused here, by its
        key, rather than later by the name of the spec's field in base units."""
        if value is None:
            return None
        out = value * scale
        if not math.isfinite(out):
            raise self.error(
                key, f"is not a realistic figure: {fmt_number(value)} overflows once converted from its unit", fix
            )
        return out

    def boolean(self, key: str, default: Any = MISSING) -> Any:
        """``true`` or ``false``."""
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {_show(value)}", "write true or false")
        return value

    def text(self, key: str, default: Any = MISSING) -> Any:
        """A non-empty string."""
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return default
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"must be a non-empty text, got {_show(value)}", "write a name in quotes")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (YAML's "\ud800") is no character: no file or terminal can hold it.
            raise self.error(
                key, f"holds a code point that is no Unicode character, got {value!a}", "remove the \\uD8xx escape"
            ) from None
        return value

    def choice(self, key: str, choices: Iterable[str], default: Any = MISSING) -> Any:
        """One of ``choices`` (case-insensitive; ``-`` and ``_`` are equivalent)."""
        options = tuple(choices)
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return default
        normal = str(value).strip().lower().replace("-", "_") if isinstance(value, str | int) else None
        for option in options:
            if normal == option.lower().replace("-", "_"):
                return option
        hint = did_you_mean(str(value), options) if isinstance(value, str) else ""
        raise self.error(key, f"must be one of {', '.join(options)}; got {_show(value)}{hint}", "pick one of those")

    def int_list(self, key: str, default: Any = MISSING, *, minimum: int | None = None) -> Any:
        """A list of integers."""
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return default
        if not isinstance(value, list):
            raise self.error(key, f"must be a list of whole numbers, got {_show(value)}", "write [1, 2, 3]")
        out: list[int] = []
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int):
                raise self.error(f"{key}[{i}]", f"must be a whole number, got {_show(item)}", _number_fix(item, key))
            if minimum is not None and item < minimum:
                raise self.error(f"{key}[{i}]", f"must be >= {minimum}, got {item}", f"use values >= {minimum}")
            out.append(item)
        return tuple(out)

    def number_list(self, key: str, default: Any = MISSING) -> Any:
        """A list of finite numbers."""
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return default
        if not isinstance(value, list):
            raise self.error(key, f"must be a list of numbers, got {_show(value)}", "write [0.5, 0.7]")
        out: list[float] = []
        for i, item in enumerate(value):
            if not is_finite_number(item):
                raise self.error(f"{key}[{i}]", f"must be a finite number, got {_show(item)}", _number_fix(item, key))
            out.append(float(item))
        return tuple(out)

    def sub(self, key: str, default: Any = MISSING, *, keys: Iterable[str] = ()) -> Any:
        """The nested mapping under ``key`` as a :class:`Fields` (or ``default`` when absent); ``keys`` as for
        the constructor."""
        value = self.raw(key, default)
        if value is default and default is not MISSING:
            return default
        return Fields(value, self.where, self.path(key), keys)

    def done(self, *, ignore: Iterable[str] = ()) -> None:
        """Reject keys that were never read, suggesting the closest known key."""
        known = self.used | set(ignore)
        for key in self.data:
            if key not in known:
                hint = did_you_mean(str(key), sorted(known))
                raise self.error(
                    str(key),
                    f"unknown key{hint}",
                    f"remove it or use one of: {', '.join(sorted(known))}",
                )


def _check_range(f: Fields, key: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise f.error(
            key, f"must be >= {fmt_number(lo)}, got {fmt_number(value)}", f"use a value of at least {fmt_number(lo)}"
        )
    if hi is not None and value > hi:
        # A bound of 2**53 (MAX_COUNT) reads as its digits grouped, not as 'a number of 16 digits'.
        bound = f"{hi:,}" if isinstance(hi, int) and hi >= 10**15 else fmt_number(hi)
        raise f.error(key, f"must be <= {bound}, got {fmt_number(value)}", f"use a value of at most {bound}")


def fmt_number(x: float) -> str:
    """A number for an error message: whole ones as integers, huge ones by their size, not their digits."""
    # Whole numbers as integers, but not the hundreds of digits of a huge number (1e300 stays 1e+300, 10**400 is
    # shown by its digit count: it has no float form).
    if isinstance(x, int) and abs(x) >= 10**15:
        return f"a number of {len(str(abs(x)))} digits"
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def kind_of(value: Any) -> str:
    """How an error names a value's YAML type: 'a list', 'a text', 'nothing (empty)' ..."""
    return {
        list: "a list",
        str: "a text",
        int: "a number",
        float: "a number",
        bool: "true/false",
        type(None): "nothing (empty)",
    }.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f"the text {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, int) and not isinstance(value, bool):
        return fmt_number(value)
    return repr(value)


# The unit a key's name gives, by suffix, for the hint on exponent notation (989e12 in peak_tflops_bf16 was
# meant as 989 TFLOP/s).
_KEY_UNITS = (
    ("_tflops", "TFLOP/s"),
    ("_gbit_per_s", "Gb/s"),
    ("_gb_per_s", "GB/s"),
    ("_gib", "GiB"),
    ("_us", "µs"),
    ("_watts", "W"),
    ("_usd", "USD"),
)


def _key_unit(key: str) -> str:
    for marker, unit in _KEY_UNITS:
        if marker in key:
            return unit
    return ""


def _yaml_number(x: float) -> str:
    """``x`` as YAML 1.1 reads it back as a number: plain when whole, else with a dot and a signed exponent."""
    if x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    mantissa, exponent = f"{x:.6e}".split("e")
    mantissa = mantissa.rstrip("0")
    mantissa += "0" if mantissa.endswith(".") else ""
    return f"{mantissa}e{int(exponent):+d}"


def _number_fix(value: Any, key: str = "") -> str:
    """The fix for a value that is not a number; ``key`` (the key it was read for) names the unit, if any."""
    if isinstance(value, str) and _NUMBER_TEXT.match(value) and any(c.isdigit() for c in value):
        text = value.strip()
        if "e" in text.lower():
            # PyYAML implements YAML 1.1, whose floats need a dot and a signed exponent: 1.0e+6 is a number,
            # 1e6 and 1.0e6 are text (yaml.resolver's float pattern).
            try:
                meant = float(text)
            except ValueError:
                meant = None
            written = f"write {_yaml_number(meant)}" if meant is not None and math.isfinite(meant) else "write it"
            fix = (
                f"YAML reads exponent notation as a number only with a dot and a signed exponent (1.0e+6, not 1e6): "
                f"{written}"
            )
            unit = _key_unit(key.rsplit(".", 1)[-1])
            if unit:
                example = " (989e12 FLOP/s is 989 TFLOP/s)" if unit == "TFLOP/s" else ""
                fix += f", or, as {key} is in {unit}, the figure in that unit{example}"
            return fix
        return f"remove the quotes: write {text}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "write a realistic figure"  # a number, but not a finite one (inf, nan, or beyond any float)
    return "write a plain number without quotes"


# -- specs built in Python --------------------------------------------------------------------------------------
# The readers above check what a file says. A spec built directly in Python (a sweep over a DataFrame, a
# notebook) gets the same checks from its ``__post_init__`` through these helpers.

_SCALAR_KINDS: dict[type, tuple[tuple[str, str, bool], ...]] = {}
_PYTHON_TYPE = {"int": int, "float": float, "bool": bool, "str": str}


def _scalar_fields(cls: type) -> tuple[tuple[str, str, bool], ...]:
    """(name, kind, may be None) of a dataclass's int, float, bool and str fields, from its annotations."""
    hit = _SCALAR_KINDS.get(cls)
    if hit is None:
        out = []
        for f in dataclasses.fields(cls):
            annotation = str(f.type).replace(" ", "")
            base = annotation.removesuffix("|None")
            if base in ("int", "float", "bool", "str"):
                out.append((f.name, base, base != annotation))
        hit = _SCALAR_KINDS[cls] = tuple(out)
    return hit


def check_scalar_types(spec: Any) -> None:
    """Check that every int, float, bool and str field of the frozen dataclass ``spec`` holds one, and turn
    numpy scalars (and floats with whole values in int fields) into Python ones, in place.

    Raises
    ------
    SpecError
        Naming the field and the value: text where a number belongs, NaN, a fraction in a whole-number field.
    """
    for name, kind, optional in _scalar_fields(type(spec)):
        value = getattr(spec, name)
        exact = type(value) is _PYTHON_TYPE[kind]
        if exact and (kind != "float" or math.isfinite(value)):
            continue  # the common case first: plans are copied thousands of times in a search
        if value is None and optional:
            continue
        if kind == "str":
            raise SpecError(name, f"must be text, got {_show(value)}", "write it as a string")
        if kind == "bool":
            if not isinstance(value, np.bool_):
                raise SpecError(name, f"must be true or false, got {value!r}", "use True or False")
            object.__setattr__(spec, name, bool(value))
            continue
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            expected = "a whole number" if kind == "int" else "a finite number"
            raise SpecError(name, f"must be {expected}, got {value!r}", "write a number such as 8")
        if kind == "int":
            if not float(value).is_integer():
                raise SpecError(name, f"must be a whole number, got {value!r}", "write a number such as 8")
            # An integer type converts exactly (numpy int64 beyond 2**53 too); a whole float through float.
            exact_int = operator.index(value) if isinstance(value, numbers.Integral) else int(float(value))
            object.__setattr__(spec, name, exact_int)
        else:
            object.__setattr__(spec, name, float(value))


# The largest count a spec accepts: 2**53, beyond which integers are not exact as the floats the cost models
# compute in (IEEE 754 binary64), and a product of two such sizes overflows float conversion. No real model,
# batch or cluster comes near it; a larger value is a typo (found by trying seq_len 10**400: an OverflowError).
MAX_COUNT = 2**53


def check_count(name: str, value: Any) -> None:
    """A count of layers, tokens, GPUs... must be at most :data:`MAX_COUNT`."""
    if value is not None and not isinstance(value, bool) and value > MAX_COUNT:
        raise SpecError(name, f"must be at most 2**53 ({MAX_COUNT:,}), got {fmt_number(value)}", f"fix {name}: a typo?")


def check_whole(where: str, value: Any, fix: str) -> None:
    """An argument of the Python API that counts something (workers, GPUs, the layouts to rank) must be a whole
    number >= 1; ``True`` is not one."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(where, f"must be a whole number >= 1, got {value!r}", fix)


def check_ranges(spec: Any, minimums: Mapping[str, float], fix: str = "") -> None:
    """Each named field of ``spec`` (None skipped) must be at least its minimum, and at most MAX_COUNT; the
    SpecError names it."""
    for name, minimum in minimums.items():
        value = getattr(spec, name)
        if value is not None and value < minimum:
            raise SpecError(
                name,
                f"must be >= {fmt_number(minimum)}, got {fmt_number(value)}",
                fix or f"use {name} >= {fmt_number(minimum)}",
            )
        check_count(name, value)


def check_positive(spec: Any, names: Iterable[str], fix: str) -> None:
    """Each named field of ``spec`` must be > 0 (a bandwidth, a memory size)."""
    for name in names:
        value = getattr(spec, name)
        if not value > 0:
            raise SpecError(name, f"must be > 0, got {value!r}", fix)


def check_choices(spec: Any, choices: Mapping[str, tuple[str, ...]], optional: Iterable[str] = ()) -> None:
    """Each named field of ``spec`` must be one of its choices (or None, for the fields in ``optional``)."""
    may_be_none = set(optional)
    for name, allowed in choices.items():
        value = getattr(spec, name)
        if value is None and name in may_be_none:
            continue
        if not isinstance(value, str) or value not in allowed:
            raise SpecError(name, f"must be one of {', '.join(allowed)}, got {value!r}", "pick one")
