"""``clustersim calibrate``: profile kernels, import third-party profiles, fit tables, check against real steps.

Subcommands (PyTorch is needed only for ``profile``, ``check`` and ``host``; install ``clustersim[profile]``):

* ``profile --device cuda|cpu --model M [--tp 1,2] [--micro-batch 1,2] [--fp8] [--collectives] --out DIR``
* ``import-vidur``, ``import-nccl-tests``, ``import-torch-profiler``: third-party measurements to rows
* ``fit DIR_OR_CSV... --out TABLE.yaml [--device NAME]``: rows to an efficiency table, with a residual report
* ``check --device cuda|cpu``: train a small real GPT, predict it, print both
* ``host``: the whole loop on this machine, ending in device, cluster and calibration profiles

Errors the user can fix raise :class:`~simulator.errors.CalibrationError` or
:class:`~simulator.errors.SpecError`; the top-level CLI prints them as ``error: ...`` with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from simulator.errors import CalibrationError

__all__ = ["add_calibrate_parser"]

EXIT_OK = 0
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C


def _whole_number(text: str, minimum: int) -> int:
    """``text`` as a whole number >= ``minimum``, or an argparse error saying what was expected."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
    return value


def _threads(text: str) -> int:
    """An argparse type: CPU threads per rank, 1 to the machine's cores (100,000 crashed PyTorch's thread pool)."""
    value = _whole_number(text, 1)
    cores = os.cpu_count() or 1
    if value > cores:
        raise argparse.ArgumentTypeError(f"expected at most the {cores} CPU cores of this machine, got {text!r}")
    return value


def _ints(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated positive whole numbers (``1,2,4``)."""
    try:
        values = tuple(_whole_number(v.strip(), 1) for v in text.split(",") if v.strip())
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{err} in {text!r} (comma-separated, e.g. 1,2,4)") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers such as 1,2,4, got {text!r}")
    return values


# --micro-batch's bound: the simulator's planner tries up to 16 sequences, and a decoder layer's activations for
# 1,024 sequences of 2,048 tokens at hidden 4,096 are 1,024·2,048·4,096·34 B ≈ 290 GB (Korthikanti et al. 2022's
# 34·s·b·h bytes per layer), past any one GPU; a larger size only allocates until the machine swaps.
MAX_PROFILE_MICRO_BATCH = 1024


def _micro_batches(text: str) -> tuple[int, ...]:
    """An argparse type: ``_ints`` of at most :data:`MAX_PROFILE_MICRO_BATCH` sequences each."""
    values = _ints(text)
    if max(values) > MAX_PROFILE_MICRO_BATCH:
        raise argparse.ArgumentTypeError(
            f"expected micro-batch sizes of at most {MAX_PROFILE_MICRO_BATCH:,} sequences, got {text!r}"
        )
    return values


# --sustain's bound: a GPU reaches its power-limited clock within a minute or two of load (the README asks for 60 or
# more); an hour is far past that, and 1e30 s ran forever.
MAX_SUSTAIN_S = 3600.0


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (0 <= value <= MAX_SUSTAIN_S):
        raise argparse.ArgumentTypeError(f"expected a number of seconds from 0 to {MAX_SUSTAIN_S:.0f}, got {text!r}")
    return value


def _holdout(text: str) -> int:
    """An argparse type: 0 (no held-out report) or every how many shapes to leave out, 2 or more (1 would leave
    every shape out and nothing to fit)."""
    value = _whole_number(text, 0)
    if value == 1:
        raise argparse.ArgumentTypeError(
            f"expected 0 (no held-out report) or a whole number >= 2, got {text!r}: 1 would leave every shape out "
            "of the fit"
        )
    return value


def _fit_reads(folder: Path) -> list[Path]:
    """The files ``fit`` reads inside ``folder``: its measurement CSVs, and a profile's manifest and failures
    (missing_shapes), which an output must not replace."""
    from simulator.calibration.profile import FAILURES, MANIFEST
    from simulator.calibration.rows import measurement_files

    return [*measurement_files([folder]), *(f for f in (folder / MANIFEST, folder / FAILURES) if f.is_file())]


def _vidur_reads(folder: Path) -> list[Path]:
    """The files ``import-vidur`` reads inside a Vidur profiling ``folder``."""
    return sorted([*folder.glob("compute/*/*/mlp.csv"), *folder.glob("network/*/*.csv")])


def _whole(minimum: int) -> Any:
    """An argparse type: a whole number >= ``minimum`` (a repeat count of 0 or a negative length is bad input,
    not a run that measures nothing or crashes later)."""
    return lambda text: _whole_number(text, minimum)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _configs(name: str | None, device: str) -> tuple[Any, ...]:
    from simulator.calibration.check import CPU_CONFIGS, GPU_CONFIGS, TINY_CONFIGS

    choice = name or ("cpu" if device == "cpu" else "gpu")
    return {"cpu": CPU_CONFIGS, "gpu": GPU_CONFIGS, "tiny": TINY_CONFIGS}[choice]


# -- profile ------------------------------------------------------------------------------------------------


def _cmd_profile(args: argparse.Namespace) -> int:
    from simulator.calibration.profile import collective_shapes, model_shapes, probe_shapes, run_profile
    from simulator.specs.library import load_model

    if not args.model and not args.configs:
        raise CalibrationError("calibrate profile: give --model (name, YAML or config.json) or --configs cpu|gpu|tiny")
    _out_folder(args.out)
    if args.collectives and args.ranks < 2:
        raise CalibrationError(
            f"--collectives needs --ranks >= 2 (local processes exchanging data), got {args.ranks}; "
            "give --ranks 2 or more, or leave out --collectives"
        )
    if args.collectives:
        from simulator.calibration.workflow import check_ranks

        check_ranks(args.ranks, args.device)
    fp8 = args.fp8 or args.fp8_emulated
    shapes: dict[str, Any] = {}
    for ref in args.model or ():
        model = load_model(ref)
        for s in model_shapes(model, seq_len=args.seq_len, micro_batches=args.micro_batch, tps=args.tp, fp8=fp8):
            shapes.setdefault(s.key, s)
    if args.configs:
        for cfg in _configs(args.configs, args.device):
            mbs = sorted({*args.micro_batch, cfg.micro_batch})
            for s in model_shapes(cfg.model(), micro_batches=mbs, tps=args.tp, fp8=fp8):
                shapes.setdefault(s.key, s)
    colls = collective_shapes(args.ranks, args.device) if args.collectives else ()
    try:
        report = run_profile(
            [*shapes.values(), *(probe_shapes(args.device, fp8=fp8) if not args.no_probes else ())],
            args.out,
            device=args.device,
            threads=args.threads,
            warmup=args.warmup,
            repeats=args.repeats,
            passes=args.passes,
            cold_cache=args.cold_cache,
            collectives=colls,
            sustain_s=args.sustain,
            fp8_emulated=args.fp8_emulated,
            log=_say,
        )
    except KeyboardInterrupt:
        return _interrupted(args.out)
    rows = f" ({report.rows} rows, one per pass)" if report.rows != report.measured else ""
    print(
        f"profiled on {report.device}: {report.measured} shapes measured now{rows}, {report.resumed} kept from an "
        f"earlier run, {report.planned} planned in {report.out}"
    )
    _print_missing(report.missing)
    return EXIT_OK


def _interrupted(folder: Path) -> int:
    """Ctrl-C: one line saying what the profile folder keeps (rows are flushed one at a time), not a traceback."""
    from simulator.calibration.profile import COLLECTIVES_CSV, KERNELS_CSV

    kept = 0
    for name in (KERNELS_CSV, COLLECTIVES_CSV):
        if (folder / name).is_file():
            with (folder / name).open("rb") as fh:
                kept += max(sum(1 for _ in fh) - 1, 0)  # less the header
    _say(f"interrupted; {kept} rows kept in {folder} (rerun the same command to measure the rest)")
    return EXIT_INTERRUPTED


def _print_missing(missing: Sequence[tuple[str, str]]) -> None:
    """The shapes a profile has no row for: those that failed (a rerun fails alike unless the cause is fixed: an
    out-of-memory shape needs a smaller --micro-batch or --seq-len, or a GPU with more memory), then those the run
    never reached (a rerun measures them)."""
    from simulator.calibration.profile import NOT_MEASURED

    failed = [(key, why) for key, why in missing if why != NOT_MEASURED]
    unreached = [key for key, why in missing if why == NOT_MEASURED]
    if failed:
        oom = any("out of memory" in why.lower() or "outofmemory" in why.lower() for _, why in failed)
        fix = "lower --micro-batch or --seq-len, or profile on a GPU with more memory" if oom else "fix the cause"
        print(f"failed {len(failed)} shapes (a rerun retries them, and fails again unless you {fix}):")
        for key, why in failed:
            print(f"  {key}: {why}")
    if unreached:
        print(f"not measured {len(unreached)} shapes (the run stopped first; rerun the same command to measure them):")
        for key in unreached:
            print(f"  {key}")


# -- importers ----------------------------------------------------------------------------------------------


def _write_import(rows: list[Any], out: Path, what: str, notes: list[str]) -> int:
    """Write imported rows; every note (input rows the importers dropped, and why) goes to stderr first."""
    from simulator.calibration.rows import write_rows

    for note in notes:
        _say(f"note: {note}")
    if not rows:
        raise CalibrationError(f"{what}: no rows imported; check the input files")
    n = write_rows(rows, out)
    dropped = f" ({len(notes)} note(s) above on input rows left out)" if notes else ""
    print(f"wrote {n} rows to {out}{dropped}")
    return EXIT_OK


def _cmd_import_vidur(args: argparse.Namespace) -> int:
    from simulator.calibration.importers.vidur import import_vidur_compute, import_vidur_network, import_vidur_tree
    from simulator.calibration.rows import input_file

    rows: list[Any] = []
    notes: list[str] = []
    for path in args.paths:
        if path.is_dir():
            rows += import_vidur_tree(path, args.device, notes=notes)
            continue
        input_file(path, "a Vidur mlp.csv, network CSV or profiling folder")
        if path.name == "mlp.csv":
            rows += import_vidur_compute(path, args.device, notes=notes)
        else:
            rows += import_vidur_network(path, args.device, notes=notes)
    return _write_import(rows, args.out, "import-vidur", notes)


def _cmd_import_nccl(args: argparse.Namespace) -> int:
    from simulator.calibration.importers.nccl_tests import collective_name, import_nccl_tests, import_vtrain_table
    from simulator.calibration.rows import input_file

    collective = collective_name(args.collective) if args.collective else None
    rows: list[Any] = []
    notes: list[str] = []
    for path in args.paths:
        input_file(path, "nccl-tests output or a vTrain table")
        with path.open(encoding="utf-8", errors="replace") as fh:
            first = fh.readline()
        if first.startswith("size"):
            if collective not in (None, "all_reduce"):
                raise CalibrationError(
                    f"{path}: a vTrain table times all-reduce only, but --collective is {collective}; "
                    "leave out --collective for vTrain tables"
                )
            rows += import_vtrain_table(
                path, device=args.device or "A100-SXM4-80GB", ranks=args.ranks, scope=args.scope, notes=notes
            )
        else:
            rows += import_nccl_tests(
                path, collective=collective, device=args.device or "", ranks=args.ranks, scope=args.scope, notes=notes
            )
    return _write_import(rows, args.out, "import-nccl-tests", notes)


def _cmd_import_torch(args: argparse.Namespace) -> int:
    from simulator.calibration.importers.torch_profiler import import_torch_trace

    rows: list[Any] = []
    notes: list[str] = []
    for path in args.paths:
        rows += import_torch_trace(path, device=args.device or "", scope=args.scope or "", notes=notes)
    return _write_import(rows, args.out, "import-torch-profiler", notes)


# -- fit ----------------------------------------------------------------------------------------------------


def _residual_lines(summary: dict[str, dict[str, float]]) -> list[str]:
    width = max([22, *(len(key) + 1 for key in summary)])  # attention_causal_bwd:bf16 is longer than most
    lines = [f"  {'curve':<{width}}{'held out':>9}{'median |err|':>14}{'p90 |err|':>11}"]
    for key, s in summary.items():
        lines.append(
            f"  {key:<{width}}{int(s['n']):>9}{s['median_abs_error'] * 100:>13.1f}%{s['p90_abs_error'] * 100:>10.1f}%"
        )
    return lines


def _cmd_fit(args: argparse.Namespace) -> int:
    from simulator.calibration.host import device_mapping, write_yaml
    from simulator.calibration.workflow import fit_files, summarize_errors, write_table
    from simulator.specs.library import load_device

    if args.out.suffix not in (".yaml", ".yml"):
        raise CalibrationError(f"--out {args.out}: must be a .yaml file, e.g. hardware_profiles/calibration/NAME.yaml")
    device = load_device(args.device) if args.device else None
    name = args.name or args.out.stem
    _plain_name(name, "--name")
    result = fit_files(
        args.paths,
        name=name,
        device=device,
        holdout_every=args.holdout,
        ranks=args.ranks,
        only_device=tuple(args.only_device),
    )
    for note in result.notes:
        _say(f"note: {note}")
    write_table(result.table, args.out, "fitted by clustersim calibrate fit")
    if args.device_out is not None:
        write_yaml(device_mapping(result.device), args.device_out, "measured by clustersim calibrate fit")
    summary = summarize_errors(result.residuals)
    if args.format == "json":
        print(
            json.dumps(
                {
                    "table": str(args.out),
                    "device": result.device.name,
                    "derived_device": result.derived_device,
                    "rows": len(result.rows),
                    "curves": [c.op + ":" + c.precision for c in result.table.compute]
                    + [f"{b.collective}:{b.ranks}" for b in result.table.collectives],
                    "launch_overhead_us": None
                    if result.table.launch_overhead_s is None
                    else result.table.launch_overhead_s * 1e6,
                    "sustained_gemm_ratio": result.table.sustained_gemm_ratio,
                    "residuals": summary,
                    "missing": [{"folder": f, "shape": k, "reason": r} for f, k, r in result.missing],
                    "unfitted": [{"rows": n, "reason": why} for why, n in result.unfitted],
                },
                indent=2,
            )
        )
    else:
        t = result.table
        print(
            f"wrote {args.out}: {len(t.compute)} compute and {len(t.collectives)} collective curves from "
            f"{len(result.rows)} rows, relative to device {result.device.name}"
            + (" (derived from the rows' probes)" if result.derived_device else "")
        )
        for why, n in result.unfitted:
            print(f"not fitted: {n} rows, {why}")
        if t.launch_overhead_s is not None:
            print(f"launch overhead {t.launch_overhead_s * 1e6:.2f} us per operator")
        if t.sustained_gemm_ratio is not None:
            print(f"sustained GEMM throughput {t.sustained_gemm_ratio:.3f} of the profiled burst")
        if summary:
            print(f"held-out residuals (every {args.holdout}th shape left out of the fit, then predicted):")
            print("\n".join(_residual_lines(summary)))
        if result.missing:
            print(f"missing {len(result.missing)} planned shapes (profile stopped or failed; rerun it to resume):")
            for folder, key, why in result.missing:
                print(f"  {folder}: {key}: {why}")
    return EXIT_OK


# -- check and host -----------------------------------------------------------------------------------------


def _check_table(rows: Any) -> str:
    lines = [f"{'configuration':<28}{'measured':>11}{'predicted':>11}{'error':>9}"]
    for r in rows:
        lines.append(
            f"{r.config.label():<28}{r.measured_s * 1e3:>9.1f}ms{r.predicted_s * 1e3:>9.1f}ms{r.error * 100:>+8.1f}%"
        )
    if rows:
        med = statistics.median(abs(r.error) for r in rows)
        lines.append(f"median |error| {med * 100:.1f}% over {len(rows)} configurations")
    return "\n".join(lines)


def _check_json(rows: Any, device: str, warning: str = "") -> str:
    out: dict[str, Any] = {
        "device": device,
        "rows": [r.as_dict() for r in rows],
        "median_abs_error": statistics.median(abs(r.error) for r in rows) if rows else None,
    }
    if warning:
        out["warning"] = warning
    return json.dumps(out, indent=2)


def _cmd_check(args: argparse.Namespace) -> int:
    from simulator.calibration.check import device_mismatch, run_check
    from simulator.calibration.torchlib import device_name, setup_device
    from simulator.calibration.workflow import run_host
    from simulator.specs.library import load_cluster

    configs = _configs(args.configs, args.device)
    if args.no_ddp:
        configs = tuple(c for c in configs if c.ranks == 1)
    mismatch = ""
    if args.cluster is not None:
        cluster = load_cluster(args.cluster)
        if cluster.calibration is None:
            raise CalibrationError(
                f"--cluster {args.cluster}: names no calibration table; fit one (calibrate fit) or run calibrate host"
            )
        dev = setup_device(args.device, args.threads if args.device == "cpu" else None)
        mismatch = device_mismatch(args.device, device_name(dev), cluster)
        if mismatch:
            _say(f"warning: {mismatch}")
        rows = run_check(
            configs,
            cluster,
            device=args.device,
            threads=args.threads,
            steps=args.steps,
            warmup=args.warmup,
            rounds=args.rounds,
        )
    else:
        # No fitted cluster given: profile these configurations' kernels first, in a scratch folder.
        with tempfile.TemporaryDirectory(prefix="clustersim-check-") as tmp:
            work = args.work or Path(tmp)
            _say(f"no --cluster: profiling the kernels of the check configurations first (in {work})")
            result = run_host(
                work,
                device=args.device,
                configs=configs,
                micro_batches=(),
                ranks=max(c.ranks for c in configs),
                threads=args.threads,
                steps=args.steps,
                warmup=args.warmup,
                rounds=args.rounds,
                log=_say,
            )
            rows = list(result.check)
    print(_check_json(rows, args.device, mismatch) if args.format == "json" else _check_table(rows))
    if mismatch:
        _say(f"warning: {mismatch}")
    return EXIT_OK


def _out_folder(path: Path) -> None:
    """``--out`` of profile and host is a folder: refuse an existing file before anything is measured."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise CalibrationError(
                    f"--out {path}: {p} is a file, and --out names a folder for the measurements; "
                    "give a folder (it is created if missing)"
                )
            return


def _plain_name(name: str, flag: str) -> None:
    """A profile or table name becomes a file name: no folders in it (``../../x`` wrote outside --out)."""
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise CalibrationError(f"{flag} {name!r}: must be a plain name, not a path; the files go under --out")


def _cmd_host(args: argparse.Namespace) -> int:
    from simulator.calibration.workflow import run_host, summarize_errors

    if args.name is not None:
        _plain_name(args.name, "--name")
    _out_folder(args.out)
    configs = _configs(args.configs, args.device)
    try:
        result = run_host(
            args.out,
            device=args.device,
            name=args.name,
            configs=configs,
            micro_batches=args.micro_batch,
            ranks=args.ranks,
            threads=args.threads,
            steps=args.steps,
            warmup=args.warmup,
            repeats=args.repeats,
            passes=args.passes,
            rounds=args.rounds,
            cold_cache=args.cold_cache,
            check=not args.no_check,
            fp8=args.fp8 or args.fp8_emulated,
            fp8_emulated=args.fp8_emulated,
            sustain_s=args.sustain,
            log=_say,
        )
    except KeyboardInterrupt:
        return _interrupted(args.out / "profile")
    summary = summarize_errors(result.fit.residuals)
    if args.format == "json":
        print(
            json.dumps(
                {
                    "device_yaml": str(result.device_yaml),
                    "calibration_yaml": str(result.calibration_yaml),
                    "cluster_yaml": str(result.cluster_yaml),
                    "residuals": summary,
                    "rows": [r.as_dict() for r in result.check],
                    "median_abs_error": statistics.median(abs(r.error) for r in result.check) if result.check else None,
                    "wall_s": result.wall_s,
                },
                indent=2,
            )
        )
        return EXIT_OK
    print(f"device profile      {result.device_yaml}")
    print(f"calibration table   {result.calibration_yaml}")
    print(f"cluster profile     {result.cluster_yaml}")
    if summary:
        print("held-out kernel residuals:")
        print("\n".join(_residual_lines(summary)))
    if result.check:
        print(_check_table(result.check))
    print(f"wall time {result.wall_s:.0f} s; try: clustersim simulate --cluster {result.cluster_yaml} --model M ...")
    return EXIT_OK


# -- parser -------------------------------------------------------------------------------------------------


def add_calibrate_parser(sub: Any) -> None:
    """Register ``calibrate`` and its subcommands on the top-level subparsers."""
    from simulator.specs.calibration import SCOPES

    cal = sub.add_parser("calibrate", help="measure kernels and collectives, fit tables, check predictions")
    cal_sub = cal.add_subparsers(dest="calibrate_command", required=True, parser_class=type(cal))

    def device_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)")
        p.add_argument(
            "--threads", type=_threads, default=1, help="CPU threads per rank (default 1: one rank = one core)"
        )

    def fp8_emulated_opt(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--fp8-emulated",
            action="store_true",
            help="--fp8 on a device without FP8 tensor cores (the CPU): times PyTorch's emulated FP8 GEMM, to test "
            "the FP8 pipeline; the times say nothing about FP8 hardware",
        )

    def sustain_opt(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--sustain",
            type=_seconds,
            default=0.0,
            metavar="SECONDS",
            help="also time the peak GEMM after SECONDS of back-to-back load (60 or more on a GPU): the table's "
            "sustained_gemm_ratio; 0 (default) skips it",
        )

    prof = cal_sub.add_parser("profile", help="time a model's kernels (and collectives) through PyTorch")
    device_opts(prof)
    prof.add_argument("--model", action="append", help="built-in model, model YAML or config.json (repeatable)")
    prof.add_argument("--configs", choices=("cpu", "gpu", "tiny"), help="also profile the check configurations")
    prof.add_argument("--seq-len", type=_whole(1), help="sequence length (default: the model's)")
    prof.add_argument("--tp", type=_ints, default=(1,), help="tensor-parallel widths, e.g. 1,2,4,8")
    prof.add_argument("--micro-batch", type=_micro_batches, default=(1,), help="micro-batch sizes, e.g. 1,2,4")
    prof.add_argument(
        "--fp8", action="store_true", help="also time the FP8 GEMMs of FP8 training (needs FP8 tensor cores: H100...)"
    )
    fp8_emulated_opt(prof)
    prof.add_argument("--collectives", action="store_true", help="also time collectives between local ranks")
    prof.add_argument("--ranks", type=int, default=2, help="processes for --collectives (default 2)")
    prof.add_argument("--warmup", type=_whole(0), default=2)
    prof.add_argument("--repeats", type=_whole(1), default=5, help="timed runs per shape and pass (median, min, std)")
    prof.add_argument("--passes", type=_whole(1), default=1, help="time every shape once per pass, one row each")
    prof.add_argument("--cold-cache", action="store_true", help="flush the last-level cache before each timed run")
    prof.add_argument("--no-probes", action="store_true", help="skip the peak-GEMM and bandwidth probes")
    sustain_opt(prof)
    prof.add_argument("--out", type=Path, required=True, help="folder for kernels.csv, collectives.csv, manifest")
    prof.set_defaults(func=_cmd_profile)

    iv = cal_sub.add_parser("import-vidur", help="Vidur profiles (mlp.csv, network CSVs or a profiling folder)")
    iv.add_argument("paths", nargs="+", type=Path)
    iv.add_argument(
        "--device",
        help="device name for the rows (default: from Vidur's folder names a100, h100, a100_dgx, h100_dgx; needed "
        "for files in other folders; a folder of one GPU only)",
    )
    iv.add_argument("--out", type=Path, required=True, help="measurement CSV to write")
    iv.set_defaults(func=_cmd_import_vidur, reads=_vidur_reads)

    inc = cal_sub.add_parser("import-nccl-tests", help="nccl-tests output or vTrain all-reduce tables")
    inc.add_argument("paths", nargs="+", type=Path)
    inc.add_argument("--collective", help="all_reduce, all_gather, ... when the output does not say")
    inc.add_argument("--ranks", type=_whole(1), help="group size when the output does not say")
    inc.add_argument("--device", help="device name for the rows")
    inc.add_argument(
        "--scope",
        choices=SCOPES,
        help="where the groups ran: domain (one NVLink domain, also across the hosts of a GB200 NVL72 rack) or "
        "network; default: domain on one host, network when the rank lines name several",
    )
    inc.add_argument("--out", type=Path, required=True, help="measurement CSV to write")
    inc.set_defaults(func=_cmd_import_nccl)

    itp = cal_sub.add_parser("import-torch-profiler", help="PyTorch profiler (Kineto) Chrome trace JSON")
    itp.add_argument("paths", nargs="+", type=Path)
    itp.add_argument("--device", help="device name for the rows (default: from the trace)")
    itp.add_argument(
        "--scope",
        choices=SCOPES,
        help="where the collectives ran: domain (one NVLink domain) or network (across nodes); default: from each "
        "group's ranks and the host's GPUs, else domain",
    )
    itp.add_argument("--out", type=Path, required=True, help="measurement CSV to write")
    itp.set_defaults(func=_cmd_import_torch)

    fit = cal_sub.add_parser("fit", help="fit an efficiency table from measurement CSVs or profile folders")
    fit.add_argument("paths", nargs="+", type=Path, metavar="DIR_OR_CSV")
    fit.add_argument("--out", type=Path, required=True, help="table YAML to write (hardware_profiles/...)")
    fit.add_argument("--device", help="device profile the efficiencies are relative to (default: from the probes)")
    fit.add_argument("--device-out", type=Path, help="also write the derived device profile here")
    fit.add_argument(
        "--only-device",
        action="append",
        default=[],
        metavar="NAME",
        help="fit only the rows measured on this device (their `device` column, e.g. H100-SXM5-80GB; repeat it "
        "where one GPU goes by two names); rows of several devices are refused without it",
    )
    fit.add_argument("--name", help="table name (default: the file name)")
    fit.add_argument("--ranks", type=_whole(1), default=1, help="ranks sharing the host's memory (derived device only)")
    fit.add_argument(
        "--holdout",
        type=_holdout,
        default=5,
        metavar="N",
        help="leave every Nth shape out of a second fit and report how well it predicts them (default 5, N >= 2; "
        "0 skips the report)",
    )
    fit.add_argument("--format", choices=("table", "json"), default="table")
    fit.set_defaults(func=_cmd_fit, reads=_fit_reads)

    chk = cal_sub.add_parser("check", help="train a small real GPT, predict it, compare")
    device_opts(chk)
    chk.add_argument("--cluster", help="cluster name or YAML with a fitted table (default: profile first)")
    chk.add_argument("--configs", choices=("cpu", "gpu", "tiny"), help="configuration set (default: per device)")
    chk.add_argument("--no-ddp", action="store_true", help="skip the multi-process DDP configuration")
    chk.add_argument("--steps", type=_whole(1), default=5, help="timed steps per configuration (median reported)")
    chk.add_argument("--warmup", type=_whole(0), default=2)
    chk.add_argument("--rounds", type=_whole(1), default=2, help="interleaved rounds over the configurations")
    chk.add_argument("--work", type=Path, help="keep the scratch profile here (without --cluster)")
    chk.add_argument("--format", choices=("table", "json"), default="table")
    chk.set_defaults(func=_cmd_check)

    host = cal_sub.add_parser("host", help="the whole loop on this machine: device, calibration, cluster YAML")
    device_opts(host)
    host.add_argument("--out", type=Path, default=Path("clustersim-host"), help="output folder")
    host.add_argument("--name", help="profile name (default host-cpu / host-cuda)")
    host.add_argument("--configs", choices=("cpu", "gpu", "tiny"), help="configuration set (default: per device)")
    host.add_argument("--micro-batch", type=_micro_batches, default=(1, 2, 4, 8), help="micro-batches to profile")
    host.add_argument(
        "--ranks", type=int, help="ranks of the host cluster (default: 2 CPU processes, or every GPU up to 8)"
    )
    host.add_argument("--steps", type=_whole(1), default=5)
    host.add_argument("--warmup", type=_whole(0), default=2)
    host.add_argument("--repeats", type=_whole(1), default=3, help="timed runs per shape and pass")
    host.add_argument("--passes", type=_whole(1), default=3, help="passes over all shapes (one row each)")
    host.add_argument("--cold-cache", action="store_true", help="flush the last-level cache before each timed run")
    host.add_argument("--rounds", type=_whole(1), default=2, help="interleaved check rounds over the configurations")
    host.add_argument("--no-check", action="store_true", help="stop after writing the profiles")
    host.add_argument("--fp8", action="store_true", help="also time FP8 GEMMs (profile --fp8); the check stays 16-bit")
    fp8_emulated_opt(host)
    sustain_opt(host)
    host.add_argument("--format", choices=("table", "json"), default="table")
    host.set_defaults(func=_cmd_host)
