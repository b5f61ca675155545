"""The ``clustersim`` command line.

``main(argv) -> int`` parses arguments, calls the library and prints results; it never lets a traceback
reach the user for an error they caused: bad input prints ``error: <where>: <what>; <fix>`` and exits 2, an
infeasible plan exits 3. A bug in clustersim keeps its traceback.
"""

from __future__ import annotations

import argparse
import decimal
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from simulator import __version__
from simulator.errors import CalibrationError, InfeasiblePlanError, SimulatorError, SpecError
from simulator.specs._fields import check_count, did_you_mean, kind_of
from simulator.specs.plan import AUTO
from simulator.units import GIB, fmt_knob, fmt_seconds

if TYPE_CHECKING:
    from simulator.specs.hardware import ClusterSpec
    from simulator.specs.model import ModelSpec
    from simulator.specs.plan import PlanSpec

__all__ = ["main", "main_entry"]

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3
EXIT_INTERNAL = 1
# A trace larger than this gets a note: the Perfetto UI runs in the browser, which slows down on traces of a few
# hundred MB (its documentation points larger ones to trace_processor).
TRACE_NOTE_BYTES = 100_000_000


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in clustersim's one-line style and takes no abbreviated options (``--global 8``
    had been read as ``--global-batch 8``, and a later flag starting the same would have changed what it means). An
    option given twice takes its last value, as in most command lines (a shell alias of base flags, then one)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            known = self._option_names()
            hints = [f"{word}{did_you_mean(word, known)}" for word in message.split(":", 1)[1].split()]
            message = "unrecognized arguments: " + " ".join(hints)
        sys.stderr.write(f"error: {self.prog}: {message}; see '{self.prog} --help'\n")
        raise SystemExit(EXIT_BAD_INPUT)

    def _option_names(self) -> list[str]:
        """Every ``--option`` this parser and its subcommands take (argparse reports a subcommand's unknown
        option from the top parser, which cannot tell which subcommand it was)."""
        names: set[str] = set()
        parsers: list[argparse.ArgumentParser] = [self]
        while parsers:
            parser = parsers.pop()
            for action in parser._actions:
                names.update(o for o in action.option_strings if o.startswith("--"))
                if isinstance(action, argparse._SubParsersAction):
                    parsers.extend(action.choices.values())
        return sorted(names)


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout (omitted knobs take their defaults or are chosen, see README)")
    g.add_argument("--gpus", type=int, help="GPUs in the job (dp is derived when omitted)")
    g.add_argument("--tp", type=int, help="tensor-parallel degree")
    g.add_argument("--pp", type=int, help="pipeline-parallel degree")
    g.add_argument("--dp", type=int, help="data-parallel degree")
    g.add_argument("--cp", type=int, help="context-parallel degree")
    g.add_argument(
        "--ep", type=int, help="expert-parallel degree (carved out of dp·cp, or of tp·dp·cp with --expert-tp 1)"
    )
    g.add_argument(
        "--expert-tp",
        type=int,
        help="tensor parallelism inside the experts: tp (Megatron's default) or 1 (MoE parallel folding); "
        "default tp, or 1 where ep does not divide dp·cp",
    )
    g.add_argument("--vp", type=int, help="virtual pipeline chunks per stage (interleaved 1F1B); free if omitted")
    g.add_argument("--schedule", help="gpipe, 1f1b, interleaved or zb_h1 (default: 1f1b, interleaved when vp > 1)")
    g.add_argument("--micro-batch", type=int, help="sequences per micro-batch; free if omitted")
    g.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    g.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    g.add_argument("--recompute", help="none, selective or full; free if omitted")
    g.add_argument(
        "--recompute-layers",
        type=int,
        help="with --recompute full: recompute only the first N layers of each model chunk (Megatron's block method)",
    )
    g.add_argument(
        "--zero",
        type=int,
        dest="zero_stage",
        help="ZeRO stage 0-3: 1 Megatron's distributed optimizer, 2 plus gradients, 3 FSDP (default 0)",
    )
    g.add_argument("--precision", help="fp16, bf16 or fp8 (FP8 GEMMs, BF16 elsewhere; default bf16)")
    g.add_argument(
        "--grad-dtype",
        help="gradient accumulate/reduce dtype fp32, bf16 or fp16 (default, as Megatron-LM: fp32; fp16 in fp16 runs)",
    )
    g.add_argument(
        "--attention",
        help="flash (the device's fastest fused kernel, default), flash2 (FlashAttention-2), cudnn (cuDNN fused "
        "attention) or unfused (softmax)",
    )
    g.add_argument(
        "--cp-comm",
        help="how context parallelism moves keys and values: p2p (ring, default), all_gather or a2a (Ulysses)",
    )
    # On/off knobs: omitted leaves the plan's default (or, for grad_overlap, the free choice).
    flags = {
        "--sequence-parallel": "Megatron sequence parallelism on the TP group (default: on when tp > 1)",
        "--grad-overlap": "overlap the data-parallel gradient reduction with the backward pass; free if omitted",
        "--tp-overlap": "overlap TP collectives with their GEMMs (Transformer Engine userbuffers; default off)",
        "--grad-accum-fusion": (
            "weight-gradient GEMMs accumulate into the gradient buffer (Megatron's default since 2022); "
            "--no-grad-accum-fusion adds a gradient add per layer and micro-batch (2021 Megatron-LM, DeepSpeed)"
        ),
        "--align-grad-reduce": (
            "with overlapped reduction and pp > 1, stages launch it as Megatron-Core does (its default): only the "
            "first stage during its last backward; --no-align-grad-reduce: every stage during its last backward"
        ),
        "--grad-accum-upcast-copy": (
            "with --no-grad-accum-fusion: the gradient add first casts the 16-bit gradient to a copy in the "
            "buffer's dtype, a kernel of its own (DeepSpeed's BF16 optimizer)"
        ),
        "--param-gather-at-step-start": (
            "with --zero 1/2, overlapped reduction and no interleaving: every stage's first parameter bucket is "
            "all-gathered with the step (Megatron-Core 0.8 and earlier, apex DistributedFusedAdam); default: when the "
            "stage's first forward needs it (Megatron-Core 0.9 and later)"
        ),
        "--fp8-param": (
            "in FP8 training keep the FP8 GEMMs' weights in FP8 only (Megatron-Core --fp8-param-gather): no "
            "16-bit copy beside Transformer Engine's cached FP8 one, and 1-byte parameter all-gathers"
        ),
    }
    for flag, text in flags.items():
        g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
    g.add_argument(
        "--vocab-divisible-by",
        type=int,
        help="pad the vocabulary to a multiple of this times tp, as Megatron-LM's --make-vocab-size-divisible-by "
        "(default 128; 1 pads only to a multiple of tp)",
    )
    for end in ("start", "end"):
        g.add_argument(
            f"--layers-at-{end}-in-bf16",
            type=int,
            help=f"in FP8 training keep this many decoder layers at the {end} in BF16 (Megatron-Core "
            f"--first-last-layers-bf16 --num-layers-at-{end}-in-bf16; default 0)",
        )
    g.add_argument("--plan", type=Path, help="plan YAML file; options given on the command line override it")
    g.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SCOPE.KEY=VALUE",
        help="what-if override of a key of the model, cluster, device or plan (SCOPE is model, cluster, device or "
        "plan; repeatable), e.g. cluster.nic_bandwidth_gbit_per_s=800 or device.hbm_gib=76",
    )


def _mapping_file(path: Path, what: str, example: str) -> dict[str, Any]:
    """A YAML file that must hold a mapping (a plan, a grid)."""
    from simulator.specs._yaml import load_yaml_file

    raw = load_yaml_file(path)
    if not isinstance(raw, dict):
        raise SpecError(str(path), f"must be a mapping of {what} keys", f"write '{example}' lines")
    return raw


def _plan_from_args(args: argparse.Namespace, overrides: dict[str, Any]) -> Any:
    from simulator.specs._fields import Fields
    from simulator.specs.plan import PlanSpec

    data: dict[str, Any] = {}
    where = "command line"
    if args.plan is not None:
        data.update(_mapping_file(args.plan, "plan", "tp: 8"))
        where = f"{args.plan} + command line"
    # Every plan field has its flag (--tp, --zero-stage...) but the what-if factors expert_imbalance and
    # straggler_factor, set with --set plan.KEY=VALUE.
    flags = {key: getattr(args, key, None) for key in (*PlanSpec.field_names(), "gpus")}
    flags = {key: value for key, value in flags.items() if value is not None}

    # A key given both as its flag and as --set plan.KEY is a contradiction, not a precedence question; 'auto' and
    # null count as values ('--micro-batch 4 --set plan.micro_batch=auto'), case does not ('bf16' is 'BF16'), and a
    # value of the wrong type (--set plan.tp=abc) is left to the plan reader, which says what is wrong with it.
    def same(a: Any, b: Any) -> bool:
        def norm(v: Any) -> Any:
            if v is None or (isinstance(v, str) and v.strip().lower() in AUTO):
                return "auto"
            return v.strip().lower() if isinstance(v, str) else v

        na, nb = norm(a), norm(b)
        comparable = "auto" in (na, nb) or type(na) is type(nb)
        return not comparable or na == nb

    for key in sorted(flags.keys() & overrides.keys()):
        if not same(flags[key], overrides[key]):
            raise SpecError(
                f"--set plan.{key}",
                f"says {overrides[key]!r} where the flag for {key} says {flags[key]!r}",
                "give the value once",
            )
    data.update(flags)  # the command line overrides the plan file
    data.update(overrides)
    if "global_batch" not in data:
        # A mistyped key first: 'global_bach: 1536' in a plan file is the typo, not a missing flag.
        Fields(data, where).done(ignore=PlanSpec.file_keys())
        raise SpecError("--global-batch", "is required", "give the sequences per optimizer step")
    return PlanSpec.from_mapping(data, where)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from simulator.engine.trace import chrome_trace_json
    from simulator.parallel.layout import expert_load, routing_cap
    from simulator.run import simulate
    from simulator.specs.library import load_cluster, load_model, parse_overrides

    overrides = parse_overrides(args.set)
    # Every --set, so that a what-if's result says what it changed (a saved baseline and a what-if that only differ
    # in a cluster key would otherwise read the same).
    what_if = {
        f"{scope}.{k}": v
        for scope in ("model", "cluster", "device", "plan")
        for k, v in overrides.get(scope, {}).items()
    }
    model = load_model(args.model, overrides.get("model"))
    cluster = load_cluster(args.cluster, overrides.get("cluster"), overrides.get("device"))
    plan = _plan_from_args(args, overrides.get("plan", {}))
    # A plan that cannot run at all (a degree that does not divide, a precision the GPU lacks) is an answer like
    # one that does not fit: the same table or JSON document, feasible false with the reason, exit 3.
    tokens = None if args.train_tokens is None else _token_count(args.train_tokens)
    _calibration_hint(cluster)
    record = args.trace is not None or args.html is not None
    result = simulate(model, cluster, plan, record=record, raise_infeasible=False)
    unused = [k for k in ("fp8_param", "layers_at_start_in_bf16", "layers_at_end_in_bf16") if getattr(plan, k)]
    if unused and plan.precision != "fp8":
        # Accepted (a sweep over precision keeps one plan, and validate's stacks set fp8_param per source), but a
        # what-if a user expects to move the answer should not be silently inert.
        print(
            f"note: {', '.join(unused)} only {'acts' if len(unused) == 1 else 'act'} in FP8 runs; this one is "
            f"{plan.precision}, so {'it changes' if len(unused) == 1 else 'they change'} nothing",
            file=sys.stderr,
        )
    _note_inert_param_gather(result.plan, model, cluster)
    used = expert_load(result.plan, model) if model.moe is not None else 1.0
    if model.moe is not None and used < result.plan.expert_imbalance:
        caps = []
        routed = routing_cap(result.plan, model.moe)
        if routed < result.plan.expert_imbalance:
            per_rank = model.moe.num_experts / result.plan.ep
            caps.append(
                f"ep {result.plan.ep} with {per_rank:g} expert{'s' if per_rank != 1 else ''} per rank and top_k "
                f"{model.moe.top_k} (the busiest rank gets at most every routed token of its group, one copy per "
                f"expert it holds: {routed:g} times the average)"
            )
        cap = model.moe.capacity_factor
        if cap is not None and cap < result.plan.expert_imbalance:
            caps.append(f"capacity_factor {cap:g} (routing drops the tokens past it)")
        print(
            f"note: expert_imbalance {result.plan.expert_imbalance:g} is capped by {' and by '.join(caps)}: "
            f"{used:g} was used",
            file=sys.stderr,
        )
    if args.trace is not None:
        title = f"{model.name} on {cluster.name}"
        summary = result.to_dict()
        # The breakdown is the critical stage's: named, with every stage's beside it.
        keys = ("step_time_s", "plan", "breakdown", "critical_stage", "stage_breakdown", "feasible", "reason", "chosen")
        meta = {k: summary[k] for k in keys}
        meta["what_if"] = what_if
        text = chrome_trace_json(result.timeline, title=title, meta=_json_safe(meta))
        _write_output(args.trace, text, "--trace")
        if len(text) > TRACE_NOTE_BYTES:
            print(
                f"note: --trace {args.trace} holds {len(text) / 1e6:,.0f} MB ({len(result.timeline):,} rows); "
                "ui.perfetto.dev opens files this large slowly, if at all: a smaller --global-batch (fewer "
                "micro-batches) shows the same schedule",
                file=sys.stderr,
            )
        if not result.timeline:
            print(f"note: --trace {args.trace}: the plan has no timeline ({result.reason})", file=sys.stderr)
    train = None
    if tokens is not None and result.feasible:  # an out-of-memory plan's time is what it would take if it fitted
        train = result.time_to_train(tokens)
        price = cluster.device.price_per_gpu_hour_usd
        train["cost_usd"] = math.nan if price is None else train["gpu_hours"] * price
    if args.html is not None:
        _write_output(args.html, _html_report(result, args.argv, what_if, train), "--html")
    if args.format == "json":
        data = result.to_dict()
        data["what_if"] = what_if
        if tokens is not None:
            data["train"] = train  # null where the plan is infeasible
        print(json.dumps(_json_safe(data), indent=2, sort_keys=False))
    else:
        table = _result_table(result, train, tokens)
        if what_if:
            head, _, rest = table.partition("\n")
            changed = ", ".join(f"{k}={_json_safe(v)}" for k, v in what_if.items())
            table = f"{head}\nwhat-if (--set): {changed}\n{rest}"
        print(table)
    return EXIT_OK if result.feasible else EXIT_INFEASIBLE


def _html_report(result: Any, argv: Sequence[str], what_if: dict[str, Any], train: dict[str, float] | None) -> str:
    """simulate --html: the report, with the command that reproduces it (the same command without --html)."""
    import shlex

    from simulator import __version__
    from simulator.report import html_report

    rest: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--html":
            skip = True
        elif not arg.startswith("--html="):
            rest.append(arg)
    command = "clustersim " + shlex.join(rest)
    return html_report(
        result,
        command=command,
        what_if=what_if,
        train=train,
        version=__version__,
    )


_TOKEN_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def _fmt_tokens(tokens: float) -> str:
    """15e12 -> '15T', 2.5e9 -> '2.5B', 15e15 -> '15,000T', 999.999e9 -> '999.999B', 1234 -> '1,234': every
    digit the count has, up to 15 significant (as many as a float holds without noise)."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if tokens >= scale:
            return f"{tokens / scale:,.15g}{suffix}"
    return f"{tokens:,.0f}"


def _token_count(text: str, where: str = "--train-tokens") -> float:
    """``--train-tokens`` (or a file's ``where``): a positive whole number of tokens, optionally with a K, M, B (or
    G) or T suffix (read as a decimal, so that 0.1K is 100 tokens, not 100.00000000000001)."""
    raw = text.strip()
    scale = _TOKEN_SUFFIXES.get(raw[-1:].upper(), 1.0) if raw else 1.0
    number = raw[:-1] if scale != 1.0 else raw
    try:
        exact = decimal.Decimal(number) * decimal.Decimal(int(scale))
        value = float(exact) if exact.is_finite() else math.nan
    except (decimal.DecimalException, ValueError):
        exact, value = decimal.Decimal(0), math.nan
    if not (math.isfinite(value) and value >= 1):
        raise SpecError(
            f"{where} {text!r}",
            "is not a token count",
            "give a positive number of tokens, e.g. 15e12 or 15T (suffixes K, M, B, T)",
        )
    if exact != exact.to_integral_value():
        raise SpecError(
            f"{where} {text!r}",
            f"is {exact.normalize():f} tokens, not a whole number",
            "give a whole number of tokens, e.g. 2 or 1.5T",
        )
    from simulator.run import MAX_TRAIN_TOKENS

    if value > MAX_TRAIN_TOKENS:
        raise SpecError(
            f"{where} {text!r}",
            f"is {_fmt_tokens(value)} tokens, more than the {_fmt_tokens(MAX_TRAIN_TOKENS)} this answers for "
            "(the largest published pretraining runs are tens of T)",
            "check the suffix: K, M, B and T are thousands, millions, billions and trillions of tokens",
        )
    return value


def _note_inert_param_gather(plan: PlanSpec, model: ModelSpec, cluster: ClusterSpec) -> None:
    """A note on stderr where ``param_gather_at_step_start`` is set but cannot act: it moves the first parameter
    bucket's gather under ZeRO-1/2 with overlapped gathers, without interleaving, over a group of more than one
    rank (``run._param_gather_buckets``, the engine's ``_gathers_on_arrival``). Accepted, as the FP8-only knobs
    are, since a sweep keeps one plan across zero stages; read from the resolved plan, so a free knob counts as
    chosen."""
    if not plan.param_gather_at_step_start:
        return
    why = []
    if plan.zero_stage not in (1, 2):
        why.append(f"zero_stage {plan.zero_stage}: only ZeRO-1/2 gather the parameters after the step")
    if plan.grad_overlap is False:
        why.append("grad_overlap off: the gathers run after the step, not in the next one's forward")
    if plan.vp is not None and plan.vp > 1:
        why.append(f"vp {plan.vp}: the interleaved schedule dispatches the gathers itself")
    if plan.dp == 1 and not plan.free_knobs:  # a plan that cannot run keeps its free knobs, and has no layout
        from simulator.parallel.layout import resolve_layout

        try:
            alone = resolve_layout(model, cluster, plan).edp.size == 1  # experts sharded over edp, which may be > 1
        except SimulatorError:  # a plan that cannot run says so itself
            alone = False
        if alone:
            why.append("dp 1: no group to gather over")
    if why:
        print(f"note: param_gather_at_step_start changes nothing here ({'; '.join(why)})", file=sys.stderr)


def _calibration_hint(cluster: Any) -> str:
    """A note on stderr where a cluster names no calibration table but one ships for its device (a cluster YAML
    written by hand usually forgets it, and its ops then run on the default curves), or names a table measured on
    another device; returns the note."""
    from simulator.specs.library import tables_for_device

    table = cluster.calibration
    if table is not None:
        if table.device.lower() in ("any", cluster.device.name.lower()):
            return ""
        # A table of another GPU is a choice (a proxy for an unmeasured one), but never one to make unawares: its
        # efficiencies multiply this device's peaks, and the ops are not reported as uncalibrated.
        note = (
            f"note: cluster {cluster.name}'s calibration table {table.name} was measured on {table.device}, not on "
            f"its device {cluster.device.name}: its kernels run at {table.device}'s efficiencies; name a table of "
            f"{cluster.device.name}, or leave out 'calibration' for the default curves"
        )
        print(note, file=sys.stderr)
        return note
    tables = tables_for_device(cluster.device.name)
    if not tables:
        return ""
    note = (
        f"note: cluster {cluster.name} names no calibration table, so its kernels run on the default curves; "
        f"{' and '.join(tables)} measured its device {cluster.device.name}: add 'calibration: {tables[0]}' to the "
        "cluster file"
    )
    print(note, file=sys.stderr)
    return note


def _write_output(path: Path, text: str, option: str) -> None:
    """Write an output file; a path the user cannot write to is bad input (exit 2), not a traceback."""
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as err:
        raise SpecError(
            f"{option} {path}", f"cannot be written ({err.strerror or err.__class__.__name__})", "check the folder"
        ) from None


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _fmt_span(seconds: float) -> str:
    """A training time: '41 s', '24.7 minutes', '5.2 hours', '22.4 days'."""
    if seconds < 60:
        return fmt_seconds(seconds)
    if seconds < 3600:
        return f"{seconds / 60:.1f} minutes"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 86400:,.1f} days"


def _fmt_gpu_hours(hours: float) -> str:
    """Whole GPU-hours from 100 on, three significant digits below ('0.0412', '7.5', '4,411,935')."""
    return f"{hours:,.0f}" if hours >= 100 else f"{hours:.3g}"


def _fmt_tflops(value: float, decimals: int) -> str:
    """TFLOP/s with ``decimals`` decimals, or three significant digits where those would show less (a CPU's peak of
    0.22 TFLOP/s had printed as 0)."""
    return f"{value:,.{decimals}f}" if value >= 10.0 ** (1 - decimals) else f"{value:.3g}"


def _result_table(r: Any, train: dict[str, float] | None = None, tokens: float | None = None) -> str:
    p = r.plan
    lines = [
        f"{r.model} on {r.cluster}: {r.num_gpus} GPU{'' if r.num_gpus == 1 else 's'} "
        f"(tp {p.tp} · pp {p.pp} · dp {p.dp} · cp {p.cp}"
        + (f" · ep {p.ep}" if p.ep > 1 else "")
        + f"), global batch {p.global_batch} × {p.seq_len} tokens, {p.precision}",
    ]
    if not r.feasible:
        lines.append(f"infeasible: {r.reason}")
    else:
        lines.append(
            f"step time {fmt_seconds(r.step_time_s)}   tokens/s {r.tokens_per_s:,.0f}   "
            f"MFU {r.mfu * 100:.1f}%   HFU {r.hfu * 100:.1f}%"
        )
        basis = "fp16" if p.precision == "fp16" else "bf16"
        lines.append(
            f"per GPU: {r.tokens_per_s_per_gpu:,.0f} tokens/s, {_fmt_tflops(r.model_tflops_per_gpu, 1)} model "
            f"TFLOP/s, of the {basis} peak {_fmt_tflops(r.peak_tflops_per_gpu, 0)} TFLOP/s"
            + (" (FP8 runs are also rated against the 16-bit peak)" if p.precision == "fp8" else "")
        )
        if r.mfu_causal < r.mfu:
            lines.append(
                "(model FLOPs count attention at the full s², as PaLM and NeMo 2 do; Megatron-LM and Megatron-Bridge "
                f"halve causal attention: by their count MFU {r.mfu_causal * 100:.1f}%, "
                f"{_fmt_tflops(r.model_tflops_per_gpu * r.mfu_causal / r.mfu, 1)} TFLOP/s per GPU)"
            )
        if train is not None:
            cost = "" if math.isnan(train["cost_usd"]) else f", {train['cost_usd']:,.0f} USD"
            steps = f"{train['steps']:,.0f} step{'' if train['steps'] == 1 else 's'}"
            lines.append(
                f"training on {_fmt_tokens(train['tokens'])} tokens: {steps} of "
                f"{_fmt_tokens(p.global_batch * p.seq_len)} tokens, {_fmt_span(train['days'] * 86400)} on "
                f"{r.num_gpus:,} GPUs, {_fmt_gpu_hours(train['gpu_hours'])} GPU-hours{cost} (constant batch and "
                "sequence length, no restarts, evaluation or checkpoints)"
            )
    if tokens is not None and train is None:
        lines.append(f"training on {_fmt_tokens(tokens)} tokens: no training time, the plan is infeasible")
    if r.chosen:
        lines.append("chosen: " + ", ".join(f"{k}={fmt_knob(v)}" for k, v in r.chosen.items()))
    block = "" if p.recompute_layers is None else f" recompute_layers={p.recompute_layers}"
    cp_comm = f" cp_comm={p.cp_comm}" if p.cp > 1 else ""
    lines.append(
        f"layout: micro_batch={fmt_knob(p.micro_batch, 'free')} vp={p.vp or 1} schedule={p.schedule or 'auto'} "
        f"recompute={fmt_knob(p.recompute, 'free')}{block} zero={p.zero_stage} "
        f"sequence_parallel={fmt_knob(p.sequence_parallel if p.sequence_parallel is not None else p.tp > 1)}"
        f"{cp_comm}"
    )
    if r.breakdown:
        lines.append("")
        # An out-of-memory plan's step is timed as if it fitted (what it would take); say so where it is printed.
        hypothetical = "" if r.feasible else ", if the plan fitted in memory"
        lines.append(f"time breakdown (critical stage {r.critical_stage}{hypothetical})")
        total = sum(r.breakdown.values()) or 1.0
        for key, value in r.breakdown.items():
            label = key.removesuffix("_s").replace("_", " ")
            if key == "host_exposed_s" and r.launch_overhead_us is None:
                # No table measured the host's per-operator cost: it is not modelled, which is not the same as 0.
                note = "(no launch overhead measured; clustersim calibrate profile --device cuda measures it)"
                lines.append(f"  {label:<16}{'not modelled':>12}  {note}")
                continue
            lines.append(f"  {label:<16}{fmt_seconds(value, like=total):>12}  {value / total * 100:5.1f}%")
    if r.memory:
        lines.append("")
        lines.append("memory per stage (GiB)   weights    grads    optim     acts  buffers    total / capacity")
    for m in r.memory:
        mark = "  OVER" if m.over > 0 else ""
        lines.append(
            f"  stage {m.stage:<17}{m.weights / GIB:8.1f} {m.gradients / GIB:8.1f} {m.optimizer / GIB:8.1f} "
            f"{m.activations / GIB:8.1f} {m.buffers / GIB:8.1f} {m.total / GIB:8.1f} / {m.capacity / GIB:.1f}{mark}"
        )
    if r.uncalibrated_ops:
        lines.append("")
        lines.append("uncalibrated (default curves or stand-ins): " + ", ".join(r.uncalibrated_ops))
    if r.calibration:
        lines.append(f"calibration table: {r.calibration}")
    return "\n".join(lines)


def _cmd_models(args: argparse.Namespace) -> int:
    from simulator.specs.library import list_names, load_model

    if args.action == "show":
        if not args.name:
            raise SpecError("models show", "needs a model name", "e.g. clustersim models show gpt3-175b")
        m = load_model(args.name)
        print(json.dumps(m.to_mapping(), indent=2))
        print(f"parameters: {m.param_count() / 1e9:.2f} B (active {m.active_param_count() / 1e9:.2f} B)")
        return EXIT_OK
    if args.name:
        raise SpecError("models list", f"takes no name, got {args.name!r}", f"use clustersim models show {args.name}")
    rows = []
    for name, _ in list_names("model"):
        m = load_model(name)
        kind = f"MoE {m.moe.num_experts}x top-{m.moe.top_k}" if m.moe else "dense"
        rows.append(
            f"{name:<22}{m.param_count() / 1e9:9.1f} B  {kind:<16} L={m.layers:<4} h={m.hidden:<6} "
            f"heads={m.heads}/{m.kv_heads}"
        )
    print(f"{'name':<22}{'params':>11}  {'kind':<16} shape")
    print("\n".join(rows))
    return EXIT_OK


def _cmd_hardware(args: argparse.Namespace) -> int:
    from simulator.specs.library import list_names, load_cluster, load_device

    if args.action == "list":
        if args.name:
            raise SpecError(
                "hardware list", f"takes no name, got {args.name!r}", f"use clustersim hardware show {args.name}"
            )
        print("devices:")
        for name, _ in list_names("device"):
            d = load_device(name)
            half = "bf16" if "bf16" in dict(d.peak_flops) else "fp16"  # V100 has FP16 tensor cores only
            print(
                f"  {name:<20} {half} {d.peak(half) / 1e12:7.1f} TFLOP/s  memory {d.hbm_bytes / GIB:6.1f} GiB "
                f"{d.hbm_bandwidth_bytes_per_s / 1e9:6.0f} GB/s"
            )
        print("clusters:")
        for name, _ in list_names("cluster"):
            c = load_cluster(name)
            cal = c.calibration_label or "default curves"
            domain = f", domain {c.nvlink_domain_gpus}" if c.nvlink_domain_gpus != c.gpus_per_node else ""
            print(
                f"  {name:<20} {c.gpus_per_node}x {c.device.name:<18} "
                f"{_fabric(c)} {c.nvlink_bandwidth_bytes_per_s / 1e9:.0f} GB/s per direction{domain}  "
                f"{c.nics_per_node}x{c.nic_bandwidth_bytes_per_s * 8 / 1e9:.0f} Gb/s  ({cal})"
            )
        return EXIT_OK
    if not args.name:
        raise SpecError("hardware show", "needs a device or cluster name", "e.g. clustersim hardware show dgx-h100")
    names = {n.lower() for n, _ in list_names("cluster")}
    if args.name.lower() in names or args.name.endswith((".yaml", ".yml")):
        try:
            print(_cluster_text(load_cluster(args.name)))
        except SpecError:
            if args.name.lower() in names or _looks_like_cluster_file(Path(args.name)):
                raise  # a broken cluster: its own error, not a device's
        else:
            return EXIT_OK
    device_names = [n for n, _ in list_names("device")]
    if args.name.lower() not in {n.lower() for n in device_names} and not Path(args.name).is_file():
        import difflib

        every = sorted([*device_names, *(n for n, _ in list_names("cluster"))], key=str.lower)
        close = list(
            dict.fromkeys(
                [n for n in every if args.name.lower() in n.lower()][:2]
                + difflib.get_close_matches(args.name, every, n=2, cutoff=0.6)
            )
        )[:3]
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise SpecError(
            f"hardware show {args.name}",
            "is neither a built-in device nor a cluster, nor a file",
            f"{hint}clustersim hardware list shows them: {', '.join(every)}",
        )
    d = load_device(args.name)
    print(_device_text(d))
    return EXIT_OK


def _looks_like_cluster_file(path: Path) -> bool:
    """Whether a YAML file is meant as a cluster (it names a device or a node size), so that its errors are
    reported as the cluster's."""
    from simulator.specs._yaml import load_yaml_file

    if not path.is_file():
        return False
    try:
        data = load_yaml_file(path)
    except SpecError:
        return True  # unreadable either way: the cluster reader's message says why
    return isinstance(data, dict) and ("device" in data or "gpus_per_node" in data)


def _device_text(d: Any) -> str:
    lines = [f"device {d.name} ({d.vendor or 'unknown vendor'})"]
    for prec, flops in d.peak_flops:
        lines.append(f"  peak {prec:<5} {flops / 1e12:9.1f} TFLOP/s (dense)")
    # "memory", not "HBM": the L40S carries GDDR6 in the same keys.
    lines.append(f"  memory {d.hbm_bytes / GIB:.1f} GiB at {d.hbm_bandwidth_bytes_per_s / 1e9:.0f} GB/s")
    if d.sm_count:
        lines.append(f"  SMs {d.sm_count}")
    if d.tdp_watts:
        lines.append(f"  TDP {d.tdp_watts:.0f} W")
    if d.price_per_gpu_hour_usd is not None:
        lines.append(f"  price {d.price_per_gpu_hour_usd:.2f} USD per GPU-hour")
    if d.source:
        lines.append(f"  source: {d.source}")
    return "\n".join(lines)


def _fabric(c: Any) -> str:
    """The scale-up fabric's name: AMD's GPUs link by Infinity Fabric, NVIDIA's by NVLink (the spec's nvlink_* keys
    describe either)."""
    return "Infinity Fabric" if c.device.vendor == "amd" else "NVLink"


def _cluster_text(c: Any) -> str:
    lines = [
        f"cluster {c.name}",
        f"  {c.gpus_per_node} GPUs per node, {_fabric(c)} domain of {c.nvlink_domain_gpus} GPUs",
        f"  {_fabric(c)} {c.nvlink_bandwidth_bytes_per_s / 1e9:.0f} GB/s per GPU per direction"
        f"{', direct mesh (a group of k uses k-1 peer links)' if c.nvlink_topology == 'mesh' else ''}, NVLS "
        f"{'yes' if c.nvls else 'no' if c.device.vendor != 'amd' else 'n/a (an NVSwitch feature)'}",
        f"  {c.nics_per_node} NICs x {c.nic_bandwidth_bytes_per_s * 8 / 1e9:.0f} Gb/s per node "
        f"({c.nic_bandwidth_per_gpu_bytes_per_s / 1e9:.3g} GB/s per GPU), {c.topology.replace('_', '-')}, "
        f"oversubscription {c.oversubscription:g}:1",
        f"  latency {c.intra_node_latency_s * 1e6:.1f} us inside, {c.inter_node_latency_s * 1e6:.1f} us across nodes",
    ]
    if c.calibration is not None:
        t = c.calibration
        lines.append(
            f"  calibration {t.name} (measured on {t.device}): {len(t.compute)} compute curves, "
            f"{len(t.collectives)} collective curves"
            + (
                f", GEMMs under sustained load at {t.sustained_gemm_ratio:.3f} of their profiled speed"
                if t.sustained_gemm_ratio is not None
                else ""
            )
        )
    else:
        lines.append("  calibration: none (default curves)")
    if c.fabric_calibration is not None:
        t = c.fabric_calibration
        lines.append(
            f"  NVLink collectives from {t.name} (measured on the same fabric): "
            f"{sum(1 for b in t.collectives if b.scope == 'domain')} curves"
        )
    if c.source:
        lines.append(f"  source: {c.source}")
    lines.append(_device_text(c.device))
    return "\n".join(lines)


def _cmd_graph(args: argparse.Namespace) -> int:
    from simulator.graph.transformer import build_graph
    from simulator.specs.library import load_model

    model = load_model(args.model)
    seq = model.seq_len if args.seq_len is None else args.seq_len
    if seq < 1 or args.micro_batch < 1:
        raise SpecError("--seq-len/--micro-batch", f"must be >= 1, got {seq} and {args.micro_batch}", "use positive")
    check_count("--seq-len", seq)
    check_count("--micro-batch", args.micro_batch)
    check_count("--seq-len × --micro-batch (tokens per micro-batch)", seq * args.micro_batch)
    g = build_graph(model, seq, args.micro_batch, args.attention)
    rows = g.rows()
    if args.format == "json":
        out = {
            "model": model.name,
            "seq_len": seq,
            "micro_batch": args.micro_batch,
            "attention": args.attention,
            "ops": rows,
            "totals": _graph_totals(g),
        }
        print(json.dumps(out, indent=2))
    elif args.format == "dot":
        print(_graph_dot(g))
    else:
        print(f"{model.name}: seq_len {seq}, micro-batch {args.micro_batch}, attention {args.attention}")
        print(_graph_table(rows))
        t = _graph_totals(g)
        print()
        for k, v in t.items():
            print(f"{k:<34}{v:,.4g}")
    return EXIT_OK


# The graph table's columns: header, cell of a row, right-aligned. Widths follow the widest cell, so a long
# sequence's GFLOP (attn.core.bwd of Llama 3 405B at 131k tokens: 22,517,998) stays under its header.
_GRAPH_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str], bool], ...] = (
    ("block", lambda r: str(r["block"]), False),
    ("x", lambda r: str(r["count"]), True),
    ("op", lambda r: str(r["op"]), False),
    ("kind", lambda r: str(r["kind"]), False),
    ("phase", lambda r: str(r["phase"]), False),
    ("GFLOP", lambda r: f"{r['flops'] / 1e9:.2f}", True),
    ("MB moved", lambda r: f"{r['bytes'] / 1e6:.1f}", True),
    ("params M", lambda r: f"{r['params'] / 1e6:.2f}", True),
    ("act MB", lambda r: f"{r['act_bytes'] / 1e6:.1f}", True),
)


def _graph_table(rows: list[dict[str, Any]]) -> str:
    """The operator rows as aligned columns, two spaces apart."""
    cells = [[head for head, _, _ in _GRAPH_COLUMNS]] + [[cell(r) for _, cell, _ in _GRAPH_COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_GRAPH_COLUMNS))]
    return "\n".join(
        "  ".join(
            (c.rjust(w) if right else c.ljust(w))
            for c, w, (_, _, right) in zip(line, widths, _GRAPH_COLUMNS, strict=True)
        ).rstrip()
        for line in cells
    )


def _graph_totals(g: Any) -> dict[str, float]:
    layers = [b for b in g.blocks if b.name.startswith("layer.")]
    return {
        "parameters": float(g.params()),
        "forward_model_flops_per_token": g.forward_model_flops() / g.tokens,
        "step_model_flops_per_micro_batch": g.step_model_flops(),
        "activation_bytes_per_layer": sum(b.act_bytes * b.count for b in layers) / max(1, g.model.layers),
    }


def _graph_dot(g: Any) -> str:
    lines = ["digraph clustersim {", "  rankdir=TB;", "  node [shape=box, fontsize=10];"]
    for node, data in sorted(g.graph.nodes(data=True)):
        op = data["op"]
        label = f"{node}\\n{op.kind} x{data['count']}"
        lines.append(f'  "{node}" [label="{label}"];')
    for a, b in sorted(g.graph.edges()):
        lines.append(f'  "{a}" -> "{b}";')
    lines.append("}")
    return "\n".join(lines)


def _cmd_check(args: argparse.Namespace) -> int:
    from simulator.parallel.layout import batch_split_problem
    from simulator.specs._yaml import load_yaml_file
    from simulator.specs.calibration import CalibrationTable
    from simulator.specs.hardware import ClusterSpec, DeviceSpec
    from simulator.specs.hf import load_hf_config
    from simulator.specs.library import load_cluster
    from simulator.specs.model import ModelSpec
    from simulator.specs.plan import PlanSpec

    failures = cannot_run = 0
    for path in args.files:
        try:
            if path.suffix.lower() == ".json":
                load_hf_config(path)
                kind = "model (Hugging Face config)"
            else:
                data = load_yaml_file(path)
                kind = _guess_kind(data, path)
                where = str(path)
                if kind == "software stacks":
                    from simulator.validate import load_stacks

                    entries = len(load_stacks(path))
                    kind += f", {entries} entr{'y' if entries == 1 else 'ies'}"
                elif kind == "jobs":
                    head, jobs = _jobs_from_file(path)
                    if head["cluster"] is not None:
                        _jobs_file_cluster(path, head["cluster"])
                    kind += f", {len(jobs)} job{'' if len(jobs) == 1 else 's'}"
                elif kind == "model":
                    ModelSpec.from_mapping(data, where)
                elif kind == "device":
                    DeviceSpec.from_mapping(data, where)
                elif kind == "cluster":
                    cluster = load_cluster(path) if isinstance(data.get("device"), str) else None
                    if cluster is None:
                        ClusterSpec.from_mapping(data, where)
                    elif _calibration_hint(cluster):
                        other = cluster.calibration is not None  # the note is about another device's table
                        kind += (
                            ", calibrated on another device: see the note" if other else ", uncalibrated: see the note"
                        )
                elif kind == "calibration":
                    CalibrationTable.from_mapping(data, where)
                else:
                    # A plan file may leave dp or gpus, and the global batch, to the command line (simulate --gpus,
                    # --global-batch): check the rest, and say what is left.
                    # Stand-ins for what is left: dp 1, and a global batch every data-parallel degree divides.
                    ints = {k: v for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}
                    defaults: dict[str, int] = {
                        "global_batch": ints.get("gpus", ints.get("dp", 1)) * ints.get("micro_batch", 1)
                    }
                    left = [] if "global_batch" in data else ["global_batch"]
                    given = {
                        k
                        for k, v in data.items()
                        if v is not None and not (isinstance(v, str) and v.strip().lower() in AUTO)
                    }
                    if "dp" not in given and "gpus" not in given:
                        defaults["dp"] = 1
                        left.append("dp or gpus")
                    merged = {**defaults, **data}
                    if "dp" in defaults:
                        merged["dp"] = 1  # also over 'dp: auto'
                    plan = PlanSpec.from_mapping(merged, where)
                    if left:
                        kind += "; left to the command line: " + ", ".join(left)
                    elif split := batch_split_problem(plan.global_batch, plan.dp, plan.micro_batch):
                        # resolve_layout's rule, which simulate answers as a plan that cannot run
                        cannot_run += 1
                        print(
                            f"infeasible: {path}: the plan cannot run: global_batch {split}; fix global_batch, dp or "
                            "micro_batch",
                            file=sys.stderr,
                        )
                        continue
            print(f"ok: {path} ({kind})")
        except SpecError as err:
            failures += 1
            print(f"error: {err}", file=sys.stderr)
    return EXIT_BAD_INPUT if failures else EXIT_INFEASIBLE if cannot_run else EXIT_OK


def _guess_kind(data: Any, path: Path) -> str:
    from simulator.specs.library import kinds_by_keys

    if not isinstance(data, dict):
        raise SpecError(
            str(path), f"must be a mapping of keys to values, got {kind_of(data)}", "write 'key: value' lines"
        )
    # The keys decide; the folder (hardware_profiles/devices/ ...) only where they fit several kinds or none, so
    # that a model YAML kept in a folder named calibration/ is still checked as a model.
    by_keys = kinds_by_keys(data)
    if len(by_keys) == 1:
        return by_keys[0]
    if not by_keys and "stacks" in data:
        return "software stacks"  # validate's software_stacks.yaml
    if not by_keys and "jobs" in data:
        return "jobs"  # a schedule's jobs file
    folders = {p.lower() for p in path.parts}
    for folder, kind in (("calibration", "calibration"), ("devices", "device"), ("clusters", "cluster")):
        if folder in folders and (not by_keys or kind in by_keys):
            return kind
    if by_keys:
        return by_keys[0]
    raise SpecError(
        str(path),
        "is not a model, device, cluster, calibration, plan, jobs or software-stacks file",
        "check its keys",
    )


def _cmd_validate(args: argparse.Namespace) -> int:
    from simulator.validate import default_stacks_file, format_report, validate_file

    if args.stacks is not None and args.no_stacks:
        raise SpecError("--stacks/--no-stacks", "name a stacks file and ignore stacks at once", "give one of them")
    if args.out is not None and args.out.exists() and args.file.exists() and args.out.samefile(args.file):
        raise SpecError(
            f"--out {args.out}", "is the input CSV: the results would replace the measured runs", "name another file"
        )
    stacks = None if args.no_stacks else args.stacks or default_stacks_file(args.file)
    if args.out is not None and stacks is not None and args.out.is_file() and args.out.samefile(stacks):
        # The stacks file next to the CSV is read unasked, so the generic input check (--stacks only) misses it.
        raise SpecError(
            f"--out {args.out}",
            "is the stacks file this run reads: the results would replace the software stacks",
            "name another file",
        )
    report = validate_file(args.file, strict=args.strict, stacks_file=args.stacks, use_stacks=not args.no_stacks)
    text = format_report(report, args.format)
    if args.out is not None:
        # Written before the report is printed, so that a reader that stops early (``| head``) still gets the file.
        _write_output(args.out, report.rows_frame().to_csv(index=False), "--out")
    print(text)
    invalid = report.summary.get("invalid", 0)
    if invalid:
        # Every row was still reported; a file with unreadable rows is bad input all the same.
        print(
            f"error: {invalid} row(s) could not be read; each row's reason names the cell and the fix", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    return EXIT_OK


# How `clustersim sweep` ranks what fits: the column and whether smaller is better.
_RANK_BY = {
    "step_time": ("step_time_s", True),
    "throughput_per_gpu": ("tokens_per_s_per_gpu", False),
    "mfu": ("mfu", False),
    "memory": ("peak_memory_bytes", True),
}
# The most reasons of each kind a sweep's table lists (the rest are in --out / --format csv).
_SWEEP_REASONS_SHOWN = 5


def _add_sweep_options(p: argparse.ArgumentParser) -> None:
    """The plan options of `simulate`, each taking a comma-separated list of values (one axis of the grid)."""
    scratch = argparse.ArgumentParser(add_help=False)
    _add_plan_options(scratch)
    g = p.add_argument_group(
        "grid axes (each a value or comma-separated values: --tp 4,8; 'auto' leaves a free knob to the search)"
    )
    for action in scratch._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag is None or action.dest in ("plan", "set", "help"):
            continue
        on_off = isinstance(action, argparse.BooleanOptionalAction)
        text = ("true,false or one of them: " if on_off else "") + (action.help or "")
        g.add_argument(flag, dest=action.dest, metavar="V[,V...]", help=text)
    g.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SCOPE.KEY=V[,V...]",
        help="what-if axis over a key of the model, cluster, device or plan (repeatable), e.g. "
        "cluster.nic_bandwidth_gbit_per_s=200,400; each value is a labelled column of the rows",
    )


def _list_option(text: str, where: str) -> list[Any]:
    """A comma-separated option value as a list of YAML scalars (4 a number, true a boolean, auto text); a value
    that is one YAML list ([4, 8]) is read whole."""
    from simulator.specs._yaml import load_yaml_text
    from simulator.specs.library import is_plain

    if text.strip().startswith("["):
        value = load_yaml_text(text, where)
        if not isinstance(value, list):
            raise SpecError(where, f"is not a list: {text!r}", "write values separated by commas: 4,8")
        return value
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise SpecError(where, f"has an empty value in {text!r}", "write values separated by commas: 4,8")
    # A date (2001-01-01) or !!binary item is taken as its text, as a single --set value is (parse_overrides).
    return [value if is_plain(value := load_yaml_text(item, where)) else item for item in items]


def _cmd_sweep(args: argparse.Namespace) -> int:
    import time

    from simulator.sweep import cases_from_mapping, sweep

    data: dict[str, Any] = {}
    where = "command line"
    if args.grid is not None:
        data.update(_mapping_file(args.grid, "grid", "model: gpt3-175b"))
        where = f"{args.grid} + command line" if any(_given_axes(args)) else str(args.grid)
    for key, flag, text in _given_axes(args):
        data[key] = _list_option(text, flag)
    if args.top < 1:
        raise SpecError("--top", f"must be >= 1, got {args.top}", "show 1 or more of the best cases")
    sets = data.get("set")
    sets = {} if sets is None else sets
    given_sets: set[str] = set()
    for item in args.set:
        dotted, sep, value = (part.strip() for part in item.partition("="))
        if not sep or "." not in dotted:
            raise SpecError(
                f"--set {item}", "must look like scope.key=value[,value...]", "e.g. --set cluster.nics_per_node=4,8"
            )
        if dotted in given_sets:
            raise SpecError(f"--set {dotted}", "is given twice", "give each key once, with all its values")
        given_sets.add(dotted)
        if not isinstance(sets, dict):
            break  # the grid file's own 'set' is not a mapping: cases_from_mapping says so
        sets[dotted] = _list_option(value, f"--set {dotted}") if value else [None]
    if sets or "set" in data:
        data["set"] = sets
    for key in ("model", "cluster", "global_batch"):
        if data.get(key) is None:
            flag = "--" + key.replace("_", "-")
            raise SpecError(flag, "is required (on the command line or in the grid file)", f"give {flag}")
    _refuse_output_among(args.out, [*_refs(data.get("model")), *_refs(data.get("cluster"))])
    cases = cases_from_mapping(data, where)
    workers = _workers(args.workers, max(1, min(_cpus(), len(cases))))
    show = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if show:
            print(f"\rsweep: {done:,}/{total:,} cases", end="" if done < total else "\n", file=sys.stderr, flush=True)

    start = time.perf_counter()
    try:
        frame = sweep(
            cases, workers=workers, scheduler=args.scheduler, out=args.out, time_oom=args.time_oom, progress=progress
        )
    except KeyboardInterrupt:
        kept = f"; finished rows are kept in {args.out}.journal and reused by the same command" if args.out else ""
        print(f"\ninterrupted{kept}", file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - start
    counts = {
        status: int((frame["status"] == status).sum()) for status in ("ok", "out_of_memory", "cannot_run", "invalid")
    }
    column, ascending = _RANK_BY[args.rank_by]
    fitting = frame[frame["status"] == "ok"].sort_values([column, "case"], ascending=[ascending, True], kind="stable")
    if args.format == "csv":
        sys.stdout.write(frame.to_csv(index=False, lineterminator="\n"))
    elif args.format == "json":
        summary = {
            "cases": len(frame),
            **counts,
            "ranked_by": column,
            "best_case": None if fitting.empty else int(fitting.iloc[0]["case"]),
        }
        rows = [_json_safe(row) for row in frame.to_dict("records")]
        print(json.dumps({"summary": summary, "rows": rows}, indent=2))
    else:
        ran = "on the Dask cluster" if args.scheduler else f"{min(workers, len(cases))} workers" if workers > 1 else ""
        axes = [key for key, value in data.items() if isinstance(value, list) and len(value) > 1]
        print(_sweep_table(frame, fitting, counts, elapsed, ran or "in this process", args.top, args.rank_by, axes))
    if args.out is not None and args.format == "table":
        print(f"wrote {len(frame):,} rows to {args.out}")
    return EXIT_OK if counts["ok"] else EXIT_INFEASIBLE


def _simulate_flag(args: argparse.Namespace, key: str, value: Any) -> list[str]:
    """How `clustersim simulate` is told a plan value: its flag (--no-KEY for false), or --set plan.KEY=VALUE for the
    what-if factors that have none."""
    if not hasattr(args, key):
        return ["--set", f"plan.{key}={fmt_knob(value)}"]
    flag = "--zero" if key == "zero_stage" else "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag.removeprefix("--")]
    return [flag, str(value)]


def _workers(given: int | None, default: int) -> int:
    """``--workers`` as given (at least 1, else bad input), or ``default`` where it was left out."""
    if given is None:
        return default
    if given < 1:
        raise SpecError("--workers", f"must be >= 1, got {given}", "use 1 to run in this process")
    return given


def _cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform tells it)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _refs(value: Any) -> list[str]:
    """The model or cluster names a grid gives (one or a list)."""
    items = value if isinstance(value, list) else [value]
    return [item for item in items if isinstance(item, str)]


def _refuse_output_among(out: Path | None, refs: list[str]) -> None:
    """Refuse an output file that is one of the files a grid names (a model YAML or HF config.json among a list)."""
    if out is None or not out.is_file():
        return
    for ref in refs:
        path = Path(ref)
        if path.is_file() and out.samefile(path):
            raise SpecError(
                f"--out {out}",
                "is an input of this command: writing it would replace what it reads",
                "name another file",
            )


def _given_axes(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(key, flag, text) of every grid axis given on the command line."""
    from simulator.specs.plan import PlanSpec

    out = []
    for key in ("model", "cluster", "gpus", *PlanSpec.field_names()):
        text = getattr(args, key, None)
        if text is not None:
            flag = "--zero" if key == "zero_stage" else "--" + key.replace("_", "-")
            out.append((key, flag, text))
    return out


# Short headings of the plan columns a sweep's table shows.
_SWEEP_HEADINGS = {
    "micro_batch": "mb",
    "zero_stage": "zero",
    "recompute_layers": "layers",
    "grad_overlap": "overlap",
    "sequence_parallel": "sp",
    "global_batch": "batch",
}


def _sweep_table(
    frame: Any, fitting: Any, counts: dict[str, int], elapsed: float, ran: str, top: int, rank_by: str, axes: list[str]
) -> str:
    """The table of a sweep: the counts, the best ``top`` with the columns that tell them apart (the degrees, the
    grid's axes, and whatever else differs among them), and why the rest could not run."""
    from simulator.specs.plan import PlanSpec

    total = len(frame)
    lines = [
        f"sweep: {total:,} case{'s' if total != 1 else ''} in {fmt_seconds(elapsed)} ({ran}): {counts['ok']:,} fit, "
        f"{counts['out_of_memory']:,} out of memory, {counts['cannot_run']:,} cannot run, {counts['invalid']:,} invalid"
    ]
    if not fitting.empty:
        shown = fitting.head(top)
        lines.append(f"best {len(shown)} of {len(fitting):,} that fit, by {rank_by.replace('_', ' ')}:")
        # The degrees and the grid's axes always, and whatever else differs among the rows shown.
        varied = {c for c in shown.columns if shown[c].astype(str).nunique() > 1}
        varied |= {f"plan.{k}" for k in axes} | {{"gpus": "num_gpus"}.get(k, k) for k in axes}
        labels = list(frame.columns[1 : frame.columns.get_loc("status")])
        head = [("case", "case")]
        head += [(c, h) for c, h in (("model", "model"), ("cluster", "cluster"), ("num_gpus", "gpus")) if c in varied]
        head += [(c, c.removeprefix("set.")) for c in labels]
        for knob in PlanSpec.field_names():
            column = f"plan.{knob}"
            if knob in ("tp", "pp", "dp") or column in varied:
                head.append((column, _SWEEP_HEADINGS.get(knob, knob)))
        lines += _ranking(shown, head)
    for status, title in (("cannot_run", "cannot run"), ("invalid", "invalid")):
        reasons = frame.loc[frame["status"] == status, "reason"].value_counts(sort=True)
        if reasons.empty:
            continue
        lines.append(f"{title}:")
        lines += [f"  {n:,} × {reason}" for reason, n in list(reasons.items())[:_SWEEP_REASONS_SHOWN]]
        if len(reasons) > _SWEEP_REASONS_SHOWN:
            lines.append(
                f"  and {len(reasons) - _SWEEP_REASONS_SHOWN:,} more reasons (--out or --format csv has every row)"
            )
    if counts["out_of_memory"] and not counts["ok"]:
        closest = frame[frame["status"] == "out_of_memory"].sort_values(["over_bytes", "case"], kind="stable").iloc[0]
        lines.append(f"nothing fits; the closest is case {int(closest['case'])}: {closest['reason']}")
    return "\n".join(lines)


def _ranking(rows: Any, head: list[tuple[str, str]]) -> list[str]:
    """Table lines of ranked result rows (a DataFrame of ``to_row`` columns): the ``head`` columns, then the figures."""
    table = [["rank", *(h for _, h in head), "step time", "MFU", "tokens/s/GPU", "peak memory"]]
    for rank, (_, row) in enumerate(rows.iterrows(), start=1):
        cells = [str(rank), *(_sweep_cell(row[c]) for c, _ in head)]
        cells += [
            fmt_seconds(row["step_time_s"]),
            f"{row['mfu'] * 100:.1f}%",
            f"{row['tokens_per_s_per_gpu']:,.0f}",
            f"{row['peak_memory_bytes'] / GIB:.1f} GiB",
        ]
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return ["  " + "  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in table]


def _sweep_cell(value: Any) -> str:
    """A table cell: knobs as the YAML files spell them, a missing value as '-'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # a column with gaps holds its whole numbers as floats
    return fmt_knob(value, "-") if isinstance(value, bool) else str(value)


def _cmd_plan(args: argparse.Namespace) -> int:
    import time

    from simulator.search.layouts import SEARCHED, axes_of
    from simulator.search.planner import autoplan
    from simulator.specs._fields import Fields
    from simulator.specs.library import load_cluster, load_model, parse_overrides
    from simulator.specs.plan import PlanSpec
    from simulator.sweep import output_path, write_frame

    for item in args.set:
        if "," in item.partition("=")[2] and not item.partition("=")[2].strip().startswith("["):
            raise SpecError(
                f"--set {item}", "takes one value in plan", "sweep several values with clustersim sweep --set"
            )
    overrides = parse_overrides(args.set)
    model = load_model(args.model, overrides.get("model"))
    cluster = load_cluster(args.cluster, overrides.get("cluster"), overrides.get("device"))
    out = output_path(args.out)
    # Every plan value, from its flag or from --set plan.KEY (not both), read as a plan file reads it.
    raw: dict[str, tuple[str, list[Any]]] = {}
    for key, flag, text in _given_axes(args):
        if key not in ("model", "cluster"):
            raw[key] = (flag, _list_option(text, flag))
    for key, value in overrides.get("plan", {}).items():
        if key in raw:
            raise SpecError(f"--set plan.{key}", f"is also given as {raw[key][0]}", "give it once")
        raw[key] = (f"--set plan.{key}", [value])
    searched: dict[str, list[Any]] = {}
    fixed: dict[str, Any] = {}
    gpus = batch = None
    for key, (where, given) in raw.items():
        if key == "dp":
            raise SpecError(where, "is what the planner derives from --gpus and the other degrees", "leave dp out")
        if key == "gpus":
            values = [Fields({key: v}, where).integer(key, None, minimum=1) for v in given]
        else:
            values = [PlanSpec.read_value(key, v, where) for v in given]
        if key in SEARCHED:
            searched[key] = values
            continue
        if len(values) != 1:
            raise SpecError(where, f"takes one value in plan, got {len(values)}", "sweep several with clustersim sweep")
        if key == "gpus":
            gpus = values[0]
        elif key == "global_batch":
            batch = values[0]
        elif values[0] is not None:  # 'auto' leaves a free knob free
            fixed[key] = values[0]
    if gpus is None or batch is None:
        flag = "--gpus" if gpus is None else "--global-batch"
        raise SpecError(flag, "is required", f"give {flag}")
    if args.top < 1:
        raise SpecError("--top", f"must be >= 1, got {args.top}", "rank 1 or more layouts")
    workers = _workers(args.workers, _cpus())
    start = time.perf_counter()
    try:
        found = autoplan(
            model, cluster, gpus, batch, top=args.top, workers=workers, max_tp=args.max_tp, **searched, **fixed
        )
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - start
    frame = found.to_frame(model, cluster)
    if out is not None:
        write_frame(frame, out)
    best = found.best
    used = min(workers, len(found.layouts))
    ran = f"{used} workers" if used > 1 else "in this process"
    table = _plan_table(args, found, frame, model, fixed, f"{fmt_seconds(elapsed)} ({ran})")
    if args.html is not None:  # before anything is printed: an unwritable path is an error, not a half answer
        _write_output(args.html, _plan_html(args, found, model, cluster, fixed, table), "--html")
    if args.format == "csv":
        sys.stdout.write(frame.to_csv(index=False, lineterminator="\n"))
    elif args.format == "json":
        summary = {"layouts": len(found.layouts), **found.counts(), "searched": axes_of(found.layouts), "top": args.top}
        data = {"summary": summary, "best": [r.to_dict() for r in best], "layouts": frame.to_dict("records")}
        print(json.dumps(_json_safe(data), indent=2))
    if args.format == "table":
        print(table)
        if out is not None:
            print(f"wrote {len(frame):,} rows to {out}")
    return EXIT_OK if best else EXIT_INFEASIBLE


def _plan_html(
    args: argparse.Namespace, found: Any, model: ModelSpec, cluster: Any, fixed: dict[str, Any], table: str
) -> str:
    """plan --html: the table's facts, the best layouts, and the fastest simulated again with its timeline. The
    facts are the table's own first lines (what was searched, what became of the layouts, the time it took),
    except the line that says how long the search took: same inputs, same bytes."""
    from simulator import __version__
    from simulator.report import plan_report
    from simulator.run import simulate

    facts = _plan_facts(found, model, fixed, None)
    best = found.best
    if not best:
        # Nothing fits: the closest layout and why the rest cannot run, as the table says after its two lines.
        facts += [line.strip() for line in table.splitlines()[2:]]
    detail = simulate(model, cluster, best[0].plan, record=True) if best else None
    command = _reproducing_command(args, found, fixed, best[0].plan) if best else ""
    title = f"Fastest layouts of {model.name} on {found.num_gpus:,} GPUs of {found.cluster}"
    return plan_report(best, title=title, facts=facts, detail=detail, command=command, version=__version__)


def _jobs_from_file(path: Path) -> tuple[dict[str, Any], list[Any]]:
    """A jobs file: optional ``cluster`` and ``gpus``, and ``jobs``, a list of mappings with ``name``, ``model``,
    ``tokens`` (a number or 15T), ``global_batch``, and optionally ``plan`` (fixed knobs; lists of tp, pp, cp, ep or
    zero_stage narrow the search), ``min_gpus`` and ``max_gpus``."""
    from simulator.search.jobs import Job
    from simulator.search.layouts import SEARCHED
    from simulator.specs._fields import Fields
    from simulator.specs.library import load_model
    from simulator.specs.plan import PlanSpec

    where = str(path)
    f = Fields(_mapping_file(path, "jobs-file", "jobs: [...]"), where)
    head = {"cluster": f.text("cluster", None), "gpus": f.integer("gpus", None, minimum=1)}
    raw_jobs = f.raw("jobs")
    f.done()
    if not isinstance(raw_jobs, list) or not raw_jobs:
        raise SpecError(f"{where}: jobs", "must be a list of one job or more", "write '- name: ...' items under jobs")
    jobs = []
    seen: dict[str, int] = {}
    for i, item in enumerate(raw_jobs):
        j = Fields(item, where, f"jobs[{i}]")
        name = j.text("name")
        if name in seen:
            raise j.error("name", f"{name!r} is also jobs[{seen[name]}]'s name", "give every job its own name")
        seen[name] = i
        ref = j.text("model")
        try:
            model = load_model(ref)
        except SpecError as err:
            raise SpecError(j.at("model"), f"{err.where}: {err.what}", err.fix) from None
        tokens = _token_count(str(j.raw("tokens")), j.at("tokens"))
        batch = j.integer("global_batch", minimum=1)
        plan = j.sub("plan", None)
        knobs: dict[str, Any] = {}
        if plan is not None:
            for key in plan.data:
                if not isinstance(key, str):
                    raise plan.error(str(key), f"is no plan key (a {type(key).__name__})", "use a plan key, e.g. tp")
                value = plan.raw(key)
                if key == "dp":
                    raise plan.error(key, "is set by the schedule", "leave it out: it follows from the GPU count")
                if key == "global_batch":
                    raise plan.error(key, "is the job's own key", f"give it as jobs[{i}].global_batch, beside plan")
                if key in SEARCHED and isinstance(value, list):
                    if not value:
                        raise plan.error(key, "is an empty list", "give one value or more, or leave it out")
                    knobs[key] = [PlanSpec.read_value(key, v, plan.at(key)) for v in value]
                else:
                    knobs[key] = PlanSpec.read_value(key, value, plan.at(key))
            knobs = {k: v for k, v in knobs.items() if v is not None}
        low = j.integer("min_gpus", 1, minimum=1)
        high = j.integer("max_gpus", None, minimum=1)
        if high is not None and high < low:
            raise j.error("max_gpus", f"must be >= min_gpus {low}, got {high}", "raise max_gpus or lower min_gpus")
        j.done()
        jobs.append(Job(name, model, tokens, batch, knobs, low, high))
    return head, jobs


def _jobs_file_cluster(path: Path, ref: str) -> Any:
    """The cluster a jobs file names, its errors reported at the file's ``cluster`` key."""
    from simulator.specs.library import load_cluster

    try:
        return load_cluster(ref)
    except SpecError as err:
        raise SpecError(f"{path}: cluster", f"{err.where}: {err.what}", err.fix) from None


def _cmd_schedule(args: argparse.Namespace) -> int:
    from simulator.search.jobs import schedule_jobs
    from simulator.specs.library import load_cluster

    if args.gpus is not None and args.gpus < 1:
        raise SpecError("--gpus", f"must be >= 1, got {args.gpus}", "give the GPUs the jobs share")
    if args.cluster is not None and not args.cluster.strip():
        raise SpecError("--cluster", "is empty", "give a built-in cluster name or a cluster YAML")
    head, jobs = _jobs_from_file(args.jobs)
    cluster_ref = args.cluster if args.cluster is not None else head["cluster"]
    gpus = args.gpus if args.gpus is not None else head["gpus"]
    if cluster_ref is None or gpus is None:
        flag = "--cluster" if cluster_ref is None else "--gpus"
        raise SpecError(flag, "is required", f"give {flag}, or '{flag[2:]}:' in {args.jobs}")
    cluster = load_cluster(cluster_ref) if args.cluster is not None else _jobs_file_cluster(args.jobs, cluster_ref)
    workers = _workers(args.workers, _cpus())
    found = schedule_jobs(jobs, cluster, gpus, workers=workers)
    if args.format == "json":
        print(json.dumps(_json_safe(found.to_dict()), indent=2))
    else:
        print(_schedule_table(found))
    return EXIT_OK if found.best is not None else EXIT_INFEASIBLE


def _schedule_table(found: Any) -> str:
    """The three schedules, the best first, each job's GPUs, layout and time (a re-planned job's phases one per
    line), and the jobs that run nowhere."""
    from simulator.search.jobs import SCHEDULES

    def layout(p: Any) -> str:
        plan = p.result.plan
        text = f"tp {plan.tp} · pp {plan.pp} · dp {plan.dp} · cp {plan.cp}" + (
            f" · ep {plan.ep}" if plan.ep > 1 else ""
        )
        return f"{p.gpus:>6,} GPUs  {text:<28} zero {plan.zero_stage}  mb {plan.micro_batch}"

    def rows(plans: Any) -> list[str]:
        return [
            f"  {p.job:<20} {layout(p)}  step {fmt_seconds(p.result.step_time_s):>9}  {p.days:8.2f} days  "
            f"MFU {p.result.mfu * 100:4.1f}%"
            for p in plans
        ]

    def phases(found: Any) -> list[str]:
        return [
            f"  {ph.plan.job:<20} {layout(ph.plan)}  days {ph.start:7.2f} to {ph.end:7.2f} "
            f"({(ph.end - ph.start) * 24:,.1f} h)"
            for ph in found.replanned
        ]

    names = {
        "side_by_side": "side by side (each job on its own nodes, all at once)",
        "replanned": "re-planned as jobs finish (freed GPUs join the jobs still running)",
        "one_after_another": "one after another (each job alone, in the order given)",
    }
    n = len(found.jobs)
    lines = [f"{n} job{'s' if n != 1 else ''} on {found.gpus:,} GPUs of {found.cluster}"]
    order = sorted(SCHEDULES, key=lambda w: (w != found.best, SCHEDULES.index(w)))
    for which in order:
        days = found.days(which)
        if not math.isfinite(days):
            why = (
                "no job can run"
                if len(found.unplanned) == len(found.jobs)
                else "the jobs' smallest plans need more GPUs together than the cluster has"
            )
            lines.append(f"{names[which]}: not possible ({why})")
            continue
        tag = "best: " if which == found.best else ""
        idle = found.idle_gpu_days(which)
        lines.append(f"{tag}{names[which]}: all done in {days:.2f} days, {idle:,.0f} GPU-days idle")
        lines += phases(found) if which == "replanned" else rows(getattr(found, which))
    for job, why in found.unplanned:
        lines.append(f"cannot run: {job}: {why}")
    return "\n".join(lines)


def _plan_table(
    args: argparse.Namespace, found: Any, frame: Any, model: ModelSpec, fixed: dict[str, Any], took: str
) -> str:
    """The planner's table: what it searched and what became of the layouts, the best ones, and the command that
    simulates the fastest (or, where nothing fits, the closest and why the rest cannot run)."""

    lines = _plan_facts(found, model, fixed, took)
    best = found.best
    if not best:
        closest = frame[frame["status"] == "out_of_memory"].sort_values(["over_bytes", "layout"], kind="stable")
        if not closest.empty:
            row = closest.iloc[0]
            lines.append(f"nothing fits; the closest is layout {int(row['layout'])}: {row['reason']}")
        reasons = frame.loc[frame["status"] == "cannot_run", "reason"].value_counts()
        lines += [f"  {n:,} × {reason}" for reason, n in list(reasons.items())[:_SWEEP_REASONS_SHOWN]]
        return "\n".join(lines)
    rows = frame.set_index("layout").loc[list(found.best_layouts)]
    shown = ["tp", "pp", "dp", "cp", *(["ep"] if model.moe is not None else []), "zero_stage", "vp", "micro_batch"]
    shown += ["recompute", *(["recompute_layers"] if rows["plan.recompute_layers"].notna().any() else [])]
    lines.append(f"best {len(best)}, fastest first:")
    lines += _ranking(rows, [(f"plan.{k}", _SWEEP_HEADINGS.get(k, k)) for k in shown])
    lines.append("the fastest in detail (breakdown, memory per stage; add --trace step.json for its timeline):")
    lines.append("  " + _reproducing_command(args, found, fixed, best[0].plan))
    return "\n".join(lines)


def _plan_facts(found: Any, model: ModelSpec, fixed: dict[str, Any], took: str | None) -> list[str]:
    """The planner's two opening lines: the job, and what was searched and what became of the layouts (with the
    search's wall time where ``took`` is given; the HTML report leaves it out, to be the same bytes every time)."""
    from simulator.search.layouts import axes_of

    counts = found.counts()
    seq = fixed.get("seq_len") or model.seq_len
    axes = " · ".join(f"{_SWEEP_HEADINGS.get(k, k)} {','.join(map(str, v))}" for k, v in axes_of(found.layouts).items())
    return [
        f"autoplan: {model.name} on {found.cluster}, {found.num_gpus:,} GPUs, global batch {found.global_batch:,} × "
        f"{seq:,} tokens, {fixed.get('precision', 'bf16')}",
        f"searched {len(found.layouts):,} layout{'s' if len(found.layouts) != 1 else ''} ({axes})"
        f"{f' in {took}' if took else ''}: {counts['ok']:,} timed, "
        f"{counts['pruned']:,} ruled out by a lower bound, {counts['out_of_memory']:,} out of memory, "
        f"{counts['cannot_run']:,} cannot run",
    ]


def _reproducing_command(args: argparse.Namespace, found: Any, fixed: dict[str, Any], plan: PlanSpec) -> str:
    """The `clustersim simulate` command of a layout the planner found: the user's fixed knobs, then the layout and
    the choices the search made, in simulate's own flags, and the what-ifs as given."""
    import shlex

    knobs: dict[str, Any] = dict(fixed)
    for key in ("tp", "pp", "cp", "ep", "zero_stage", "vp", "micro_batch", "recompute", "recompute_layers"):
        value = getattr(plan, key)
        if value is not None and (key not in ("cp", "ep") or value > 1 or key in fixed):
            knobs[key] = value
    knobs["grad_overlap"] = plan.grad_overlap
    command = ["clustersim", "simulate", "--model", args.model, "--cluster", args.cluster]
    command += ["--gpus", str(found.num_gpus), "--global-batch", str(found.global_batch)]
    for key, value in knobs.items():
        command += _simulate_flag(args, key, value)
    command += [part for item in args.set if not item.strip().startswith("plan.") for part in ("--set", item)]
    return shlex.join(command)


def _build_parser() -> _Parser:
    from simulator.specs.plan import ATTENTION

    parser = _Parser(prog="clustersim", description="Simulate large-scale transformer training before you book it.")
    parser.add_argument("--version", action="version", version=f"clustersim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    sim = sub.add_parser("simulate", help="simulate one training step")
    sim.add_argument("--model", required=True, help="built-in model name, model YAML or HF config.json")
    sim.add_argument("--cluster", required=True, help="built-in cluster name or cluster YAML")
    _add_plan_options(sim)
    sim.add_argument(
        "--format", choices=("table", "json"), default="table", help="table (default) or json (every figure as data)"
    )
    sim.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace JSON here")
    sim.add_argument(
        "--html",
        type=Path,
        help="write a self-contained HTML report here (figures, breakdown and memory per stage, timeline, plan)",
    )
    sim.add_argument(
        "--train-tokens",
        metavar="N",
        help="also say how many steps, days and GPU-hours training on N tokens takes at this step time "
        "(a number, or with a suffix K, M, B or T: 15T)",
    )
    sim.set_defaults(func=_cmd_simulate)

    models = sub.add_parser("models", help="list or show built-in models")
    models.add_argument("action", choices=("list", "show"), help="list the built-in models, or show one")
    models.add_argument("name", nargs="?", help="with show: a built-in model name, model YAML or HF config.json")
    models.set_defaults(func=_cmd_models)

    hw = sub.add_parser("hardware", help="list or show built-in devices and clusters")
    hw.add_argument("action", choices=("list", "show"), help="list the built-in devices and clusters, or show one")
    hw.add_argument("name", nargs="?", help="with show: a device or cluster name, or a YAML file")
    hw.set_defaults(func=_cmd_hardware)

    graph = sub.add_parser("graph", help="print the operator graph of a model")
    graph.add_argument("--model", required=True, help="built-in model name, model YAML or HF config.json")
    graph.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    graph.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    graph.add_argument("--attention", choices=ATTENTION, default="flash", help="attention kernel (default flash)")
    graph.add_argument(
        "--format", choices=("table", "json", "dot"), default="table", help="table, json, or dot (Graphviz)"
    )
    graph.set_defaults(func=_cmd_graph)

    check = sub.add_parser("check", help="validate model, hardware, calibration, plan, jobs or software-stacks files")
    check.add_argument(
        "files",
        nargs="+",
        type=Path,
        help="model, device, cluster, calibration, plan, jobs or software-stacks YAML files (or HF config.json)",
    )
    check.set_defaults(func=_cmd_check)

    val = sub.add_parser("validate", help="predict measured runs from a CSV and report the error")
    val.add_argument("file", type=Path, help="CSV with the columns of data/validation/README.md")
    val.add_argument(
        "--format",
        choices=("table", "json", "csv"),
        default="table",
        help="table (default), json (summary and rows) or csv (one line per row)",
    )
    val.add_argument("--out", type=Path, help="also write per-row results as CSV")
    val.add_argument(
        "--strict", action="store_true", help="report rows that do not fit as stated as infeasible (no relaxation)"
    )
    val.add_argument(
        "--stacks",
        type=Path,
        help=(
            "software_stacks.yaml to apply (default: the one next to the CSV, else the shipped one, which sets "
            "knobs for rows whose source names a run it describes; each such row says 'stack: ...')"
        ),
    )
    val.add_argument("--no-stacks", action="store_true", help="ignore software stack annotations")
    val.set_defaults(func=_cmd_validate)

    sw = sub.add_parser(
        "sweep",
        help="simulate every combination of models, clusters and layouts; rank what fits",
        description="Simulate a grid of cases (every combination of the values given) and rank those that fit. "
        "Axes come from a grid YAML file, the options below, or both (options override the file's keys).",
    )
    sw.add_argument(
        "grid", nargs="?", type=Path, help="grid YAML: model, cluster, gpus, plan keys and set, each a value or list"
    )
    sw.add_argument("--model", help="built-in model names, model YAMLs or HF config.json files, comma-separated")
    sw.add_argument("--cluster", help="built-in cluster names or cluster YAMLs, comma-separated")
    _add_sweep_options(sw)
    sw.add_argument(
        "--workers",
        type=int,
        help="local worker processes (default: the CPUs, at most one per case; 1 runs in-process)",
    )
    sw.add_argument(
        "--dask-scheduler",
        dest="scheduler",
        metavar="ADDRESS",
        help="run the cases on the Dask cluster of this scheduler (tcp://host:8786; the 'dask' extra)",
    )
    sw.add_argument(
        "--out", type=Path, help="write every row here (.csv, .parquet or .json); a killed sweep rerun resumes from it"
    )
    sw.add_argument(
        "--format", choices=("table", "csv", "json"), default="table", help="table (default), csv or json (every row)"
    )
    sw.add_argument("--top", type=int, default=10, help="rows of the ranking the table shows (default 10)")
    sw.add_argument(
        "--rank-by",
        choices=tuple(_RANK_BY),
        default="step_time",
        help="how the table ranks what fits (default step_time)",
    )
    sw.add_argument(
        "--time-oom",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time plans that do not fit too (default); --no-time-oom answers them from memory alone, faster",
    )
    sw.set_defaults(func=_cmd_sweep)

    ap = sub.add_parser(
        "plan",
        help="find the fastest layouts of a job (auto-planner)",
        description="Search the parallel layouts of a job (tp, pp, cp, ep, ZeRO stage; micro-batch, interleaving, "
        "recomputation and overlap chosen per layout) and rank them through the engine. --tp, --pp, --cp, --ep and "
        "--zero narrow the search to those values; other plan options hold for every layout.",
    )
    ap.add_argument("--model", required=True, help="built-in model name, model YAML or HF config.json")
    ap.add_argument("--cluster", required=True, help="built-in cluster name or cluster YAML")
    _add_sweep_options(ap)
    ap.add_argument("--max-tp", type=int, help="largest tp to try (default: the NVLink domain, 8 on a DGX)")
    ap.add_argument("--top", type=int, default=5, help="how many of the fastest layouts to rank exactly (default 5)")
    ap.add_argument("--workers", type=int, help="local worker processes (default: the CPUs; the answer is the same)")
    ap.add_argument("--out", type=Path, help="write a row per layout here (.csv, .parquet or .json)")
    ap.add_argument(
        "--html",
        type=Path,
        help="write a self-contained HTML report here: the best layouts, the fastest in full with its timeline",
    )
    ap.add_argument(
        "--format",
        choices=("table", "csv", "json"),
        default="table",
        help="table (default), csv or json (every layout)",
    )
    ap.set_defaults(func=_cmd_plan)

    sch = sub.add_parser(
        "schedule",
        help="share a cluster among several training jobs",
        description="Plan several training jobs (model, tokens, global batch) on one cluster: each on every whole-node "
        "GPU count it could get, then side by side (own nodes, all at once), re-planned as jobs finish (freed GPUs "
        "join the jobs still running) and one after another (each alone); the shortest wins.",
    )
    sch.add_argument("jobs", type=Path, help="jobs YAML (see README: cluster, gpus, jobs: [...])")
    sch.add_argument("--cluster", help="built-in cluster name or cluster YAML (default: the file's)")
    sch.add_argument("--gpus", type=int, help="GPUs to share (default: the file's)")
    sch.add_argument("--workers", type=int, help="local worker processes for the planner (default: the CPUs)")
    sch.add_argument("--format", choices=("table", "json"), default="table")
    sch.set_defaults(func=_cmd_schedule)

    from simulator.calibration.cli import add_calibrate_parser

    add_calibrate_parser(sub)
    return parser


# The options that name files a command writes, and those that name files it reads (a built-in name such as
# gpt3-175b is no file and is skipped).
_OUTPUT_OPTIONS = {"out": "--out", "trace": "--trace", "html": "--html", "device_out": "--device-out"}
_INPUT_OPTIONS = (
    "model",
    "cluster",
    "plan",
    "stacks",
    "paths",
    "grid",
    "jobs",
)  # validate's CSV (`file`) has a check of its own


def _refuse_overwriting_inputs(args: argparse.Namespace) -> None:
    """Refuse an output that is one of the command's input files, or two outputs that are one file: the model YAML
    given as --trace was replaced by the trace, an nccl-tests file given as --out by the rows read from it, and a
    --device-out equal to --out left only the device where the table had been reported written. A command that reads
    folders says which files it reads in one (``reads``, a default of its parser): `calibrate fit prof --device-out
    prof/kernels.csv` had replaced the profile's measurements."""
    outputs = [(flag, Path(getattr(args, key))) for key, flag in _OUTPUT_OPTIONS.items() if getattr(args, key, None)]
    reads = getattr(args, "reads", None)
    inputs: list[Path] = []
    for key in _INPUT_OPTIONS:
        value = getattr(args, key, None)
        for item in value if isinstance(value, list | tuple) else [value]:
            if item is not None and Path(item).is_file():
                inputs.append(Path(item))
            elif item is not None and reads is not None and Path(item).is_dir():
                inputs += reads(Path(item))
    for i, (flag, out) in enumerate(outputs):
        for other_flag, other in outputs[i + 1 :]:
            if out.resolve() == other.resolve():
                raise SpecError(f"{flag} {out}", f"is also {other_flag}: one file cannot hold both", "name two files")
        if out.is_file():
            for source in inputs:
                if out.samefile(source):
                    raise SpecError(
                        f"{flag} {out}",
                        "is an input of this command: writing it would replace what it reads",
                        "name another file",
                    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 internal error, 2 bad input, 3 infeasible plan)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what reproduces the answer (simulate --html says it)
    try:
        _refuse_overwriting_inputs(args)
        code: int = args.func(args)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except CalibrationError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except InfeasiblePlanError as err:
        print(f"infeasible: {err}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except SimulatorError as err:
        # A post-run invariant failed: a defect of the simulator, not of the input.
        print(f"error: internal check failed: {err}; please report this command line as a bug", file=sys.stderr)
        return EXIT_INTERNAL
    except BrokenPipeError:
        return EXIT_OK
    except OSError as err:
        # A file a command reads or writes that the readers did not check themselves (an output folder that
        # does not exist, a read-only location): the path and the reason, not a traceback.
        where = err.filename if err.filename is not None else "a file"
        print(
            f"error: {where}: cannot be read or written ({err.strerror or err.__class__.__name__}); "
            "check the path and its permissions",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    return code


def main_entry() -> NoReturn:
    """Console-script entry point."""
    raise SystemExit(main())


if __name__ == "__main__":
    main_entry()
