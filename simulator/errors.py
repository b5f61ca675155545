"""The exception tree of clustersim.

Every error a user can cause is a :class:`SimulatorError`. Bad input (a malformed file, an unknown key,
an impossible value) is a :class:`SpecError`; a well-formed plan that cannot run (a degree that does not
divide, a stage that does not fit in memory when the caller asked for an exception) is an
:class:`InfeasiblePlanError`; problems with measured data or fitted tables are :class:`CalibrationError`.
Messages say where (file and key path), what rule was broken, the offending value and the fix, so the CLI
can print them verbatim after ``error:`` without a traceback.
"""

from __future__ import annotations

__all__ = [
    "CalibrationError",
    "InfeasiblePlanError",
    "SimulatorError",
    "SpecError",
    "not_utf8",
]


def not_utf8(data: bytes) -> str:
    """Why ``data`` is not UTF-8 text, in the words every reader of a file uses: the line and the byte in that line
    (both from 1) where it stops being UTF-8 and the byte found there, and a UTF-16 byte-order mark where the data
    starts with one (Windows' "Unicode" text). A leading UTF-8 byte-order mark is UTF-8."""
    start = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    try:
        data[start:].decode("utf-8")
    except UnicodeDecodeError as err:
        at = start + err.start
        line = data.count(b"\n", 0, at) + 1
        column = at - (data.rfind(b"\n", 0, at) + 1) + 1
        utf16 = " (it starts with a UTF-16 byte-order mark)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        return f"is not UTF-8 text: line {line}, byte {column} is 0x{data[at]:02x}{utf16}"
    return "is not UTF-8 text"


class SimulatorError(Exception):
    """Base class of every error clustersim raises on purpose."""


class SpecError(SimulatorError, ValueError):
    """An input file, mapping or argument breaks a rule.

    Parameters
    ----------
    where : str
        File and key path, e.g. ``models/gpt3.yaml: layers`` or ``--tp``.
    what : str
        The rule and the offending value, e.g. ``'tp' must divide 'heads': tp=6, heads=64``.
    fix : str, optional
        What the user should do instead.
    """

    def __init__(self, where: str, what: str, fix: str = "") -> None:
        self.where = where
        self.what = what
        self.fix = fix
        text = f"{where}: {what}" if where else what
        if fix:
            text = f"{text}; {fix}"
        super().__init__(text)

    def __reduce__(self) -> tuple[type[SpecError], tuple[str, str, str]]:
        # Rebuilt from its three parts: the default pickling passes only the message to __init__, which a
        # process pool (multiprocessing, Dask, concurrent.futures) does to send the error back, and failed
        # there, breaking the pool instead of reporting the bad plan.
        return (type(self), (self.where, self.what, self.fix))


class InfeasiblePlanError(SimulatorError):
    """A well-formed plan that cannot run on the given model and cluster."""


class CalibrationError(SimulatorError):
    """Measured data that cannot be read, or a calibration table that cannot be built or used."""
