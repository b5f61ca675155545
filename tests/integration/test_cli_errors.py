"""Bad files and arguments: every one answered with ``error: <where>: <what>; <fix>`` and exit 2, no traceback."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest

from simulator.cli import main

ROOT = Path(__file__).resolve().parents[2]

GOOD_MODEL = """\
name: small
layers: 4
hidden: 256
heads: 8
ffn_hidden: 1024
vocab: 1000
"""

GOOD_DEVICE = """\
name: dev
peak_tflops_bf16: 100
hbm_gib: 16
hbm_bandwidth_gb_per_s: 1000
"""

CASES = [
    # (file name, content, expected fragments of the message)
    (
        "dup.yaml",
        GOOD_MODEL + "layers: 8\n",
        ["dup.yaml", "line 7", "duplicate key 'layers'", "first defined on line 2"],
    ),
    ("exp.yaml", GOOD_DEVICE.replace("100\n", "989e12\n", 1), ["peak_tflops_bf16", "text '989e12'", "exponent"]),
    ("unknown.yaml", GOOD_MODEL + "hiden_size: 3\n", ["unknown.yaml: hiden_size", "unknown key"]),
    ("typo.yaml", GOOD_MODEL.replace("ffn_hidden", "ffn_hiden"), ["ffn_hidden", "has 'ffn_hiden'", "rename"]),
    ("type.yaml", GOOD_MODEL.replace("layers: 4", "layers: four"), ["type.yaml: layers", "whole number", "'four'"]),
    ("kv.yaml", GOOD_MODEL + "kv_heads: 3\n", ["kv_heads", "'kv_heads' must divide 'heads'", "heads=8, kv_heads=3"]),
    ("gated.yaml", GOOD_MODEL + "gated_mlp: true\n", ["gated_mlp=true contradicts activation=gelu"]),
    ("missing.yaml", GOOD_MODEL.replace("vocab: 1000\n", ""), ["missing.yaml: vocab", "required"]),
    ("syntax.yaml", "name: x\nlayers: [1, 2\n", ["syntax.yaml", "not valid YAML"]),
    ("negative.yaml", GOOD_MODEL.replace("heads: 8", "heads: -8"), ["heads", "must be >= 1, got -8"]),
    ("notmap.yaml", "- 1\n- 2\n", ["notmap.yaml", "must be a mapping"]),
    # An empty file was "got NoneType".
    ("empty.yaml", "", ["empty.yaml", "must be a mapping of keys to values, got nothing (empty)"]),
    (
        "cal.yaml",
        "name: t\ndevice: d\ncompute:\n  - op: gemm\n    precision: bf16\n    log10_size: [9, 8]\n"
        "    efficiency: [0.5, 0.6]\n",
        ["compute[0].log10_size", "strictly increasing"],
    ),
    (
        "cal2.yaml",
        "name: t\ndevice: d\ncompute:\n  - op: gemm\n    precision: bf16\n    log10_size: [8, 9]\n"
        "    efficiency: [0.5, 1.6]\n",
        ["compute[0].efficiency[1]", "[1e-06, 1]"],
    ),
    # Found by adversarial testing: each was a Python traceback (TypeError, RecursionError, AttributeError).
    ("complexkey.yaml", GOOD_MODEL + "? [a, b]\n: 2\n", ["complexkey.yaml: line 7", "a key is a list"]),
    ("deep.yaml", "name: " + "[" * 5000 + "]" * 5000 + "\n", ["deep.yaml", "nested too deeply"]),
    ("intkey.yaml", GOOD_MODEL + "1: 2\n", ["intkey.yaml: 1", "unknown key"]),
    # Found by fuzzing: a scalar its tag cannot build (an impossible date, an integer past Python's 4,300-digit
    # limit) was a ValueError traceback; a calibration table at denormal bandwidth or efficiency a NaN step, exit 0.
    ("date.yaml", GOOD_MODEL + "seq_len: 2001-13-45\n", ["date.yaml", "holds a value YAML cannot read"]),
    ("bigint.yaml", GOOD_MODEL + "seq_len: " + "9" * 5000 + "\n", ["bigint.yaml", "more than 4,300 digits"]),
    (
        "cal_busbw.yaml",
        "name: t\ndevice: d\ncollectives:\n  - {collective: all_reduce, scope: domain, ranks: 8, log2_bytes: [20], "
        "busbw_gb_per_s: [1.0e-310]}\n",
        ["collectives[0].busbw_gb_per_s[0]", "not a realistic bus bandwidth"],
    ),
    (
        "cal_eff.yaml",
        "name: t\ndevice: d\ncompute:\n  - {op: gemm, precision: bf16, log10_size: [8], efficiency: [1.0e-300]}\n",
        ["compute[0].efficiency[0]", "must be in [1e-06, 1]"],
    ),
    ("cal_sus.yaml", "name: t\ndevice: d\nsustained_gemm_ratio: 5.0e-324\n", ["sustained_gemm_ratio", ">= 0.1"]),
    (
        "cal_nvl.yaml",
        "name: t\ndevice: d\nmeasured_nvlink_bandwidth_gb_per_s: 1.0e+299\n",
        ["measured_nvlink_bandwidth_gb_per_s", "not a realistic figure"],
    ),
    ("hf.json", '{"model_type": "t5", "d_model": 512}', ["hf.json: model_type", "unsupported model_type 't5'"]),
    ("bad.json", '{"model_type": "llama",', ["bad.json", "not valid JSON"]),
]


def test_a_plan_file_with_auto_for_a_knob_the_simulator_does_not_choose_says_its_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """'global_batch: auto' printed '<dataclasses._MISSING_TYPE object at 0x...>' as its default, and
    'zero_stage: auto' said the default is False, not 0. Found by fuzzing."""
    plan = tmp_path / "plan.yaml"
    plan.write_text("global_batch: auto\n", encoding="utf-8")
    assert main(["check", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "give global_batch a value (it has no default)" in err
    assert "MISSING" not in err
    plan.write_text("global_batch: 8\nzero_stage: auto\n", encoding="utf-8")
    assert main(["check", str(plan)]) == 2
    assert "leave it out for the default (0)" in capsys.readouterr().err


def test_integers_read_as_yaml_1_2_does(tmp_path: Path) -> None:
    """YAML 1.1 (PyYAML's default) read a leading zero as octal and colons as base 60: `layers: 010` was 8 and
    `--set plan.global_batch=010` 8 while `--global-batch 010` is 10. Found by fuzzing."""
    from simulator.specs._yaml import load_yaml_text
    from simulator.specs.library import parse_overrides

    assert load_yaml_text("a: 010\nb: 0x10\nc: 0o10\nd: 1_000\ne: -07\nf: 1:30\ng: 1.5\n", "t") == {
        "a": 10,
        "b": 16,
        "c": 8,
        "d": 1000,
        "e": -7,
        "f": "1:30",
        "g": 1.5,
    }
    assert load_yaml_text("h: 1:10.5\ni: .5\nj: -1.5e+3\nk: .inf\n", "t") == {
        "h": "1:10.5",
        "i": 0.5,
        "j": -1500.0,
        "k": float("inf"),
    }
    assert parse_overrides(["plan.global_batch=010"]) == {"plan": {"global_batch": 10}}


def test_a_fitted_tables_latency_bound_small_messages_load(tmp_path: Path) -> None:
    """nccl-tests' 8-byte all-reduce over 8 GPUs runs at about 8e-4 GB/s of bus bandwidth, which calibrate fit
    writes as measured; the realistic-bandwidth bound (1 MB/s, the NVLink range of cluster files) refused the table
    fit had just written. A curve's points may go down to 1 KB/s. Found by a review of this change."""
    from simulator.specs.calibration import CalibrationTable

    table = CalibrationTable.from_mapping(
        {
            "name": "t",
            "device": "d",
            "collectives": [
                {
                    "collective": "all_reduce",
                    "scope": "domain",
                    "ranks": 8,
                    "log2_bytes": [3, 30],
                    "busbw_gb_per_s": [7.778e-4, 230],
                }
            ],
        },
        "t.yaml",
    )
    assert table.collectives[0].busbw_bytes_per_s[0] == pytest.approx(7.778e5)


def _check_message(err: str, fragments: list[str]) -> None:
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    # where: what; fix
    assert re.match(r"error: .+: .+; .+", line), line


@pytest.mark.parametrize(("name", "content", "fragments"), CASES, ids=[c[0] for c in CASES])
def test_check_rejects_bad_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, content: str, fragments: list[str]
) -> None:
    path = tmp_path / name
    path.write_text(content)
    if name.startswith("cal"):
        (tmp_path / "calibration").mkdir()
        path = path.rename(tmp_path / "calibration" / name)
    code = main(["check", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    _check_message(err, fragments)


def test_check_accepts_good_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "m.yaml").write_text(GOOD_MODEL)
    (tmp_path / "d.yaml").write_text(GOOD_DEVICE)
    assert main(["check", str(tmp_path / "m.yaml"), str(tmp_path / "d.yaml")]) == 0
    out = capsys.readouterr().out
    assert "ok:" in out
    assert "(model)" in out
    assert "(device)" in out


def test_check_reads_software_stacks_and_jobs_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """check refused validate's software_stacks.yaml and schedule's jobs files as no kind of file it knew, so a
    user could check neither before a long run; now each is read by the reader its command uses."""
    stacks = ROOT / "data" / "validation" / "software_stacks.yaml"
    jobs = ROOT / "analysis" / "schedules" / "two_llamas.yaml"
    assert main(["check", str(stacks), str(jobs)]) == 0
    out = capsys.readouterr().out
    assert "(software stacks, " in out
    assert "(jobs, 2 jobs)" in out
    # The example entry in data/validation/README.md is a stacks file that checks.
    readme = (ROOT / "data" / "validation" / "README.md").read_text(encoding="utf-8")
    example = tmp_path / "example_stacks.yaml"
    block = re.search(r"```yaml\n(stacks:.*?)```", readme, re.S)
    assert block is not None, "data/validation/README.md lost its software_stacks.yaml example"
    example.write_text(block.group(1))
    assert main(["check", str(example)]) == 0
    assert "(software stacks, 1 entry)" in capsys.readouterr().out
    bad = tmp_path / "software_stacks.yaml"
    bad.write_text("stacks:\n  - match: x\n    name: y\n    columns: {nodes: 8}\n    knobs: {}\n    evidence: z\n")
    assert main(["check", str(bad)]) == 2
    _check_message(capsys.readouterr().err, ["stacks[0].columns.nodes", "num_gpus"])
    bad_jobs = tmp_path / "jobs.yaml"
    bad_jobs.write_text("cluster: dgx-h1000\njobs:\n  - {name: a, model: llama3-8b, tokens: 1B, global_batch: 8}\n")
    assert main(["check", str(bad_jobs)]) == 2
    _check_message(capsys.readouterr().err, ["jobs.yaml: cluster", "dgx-h100"])
    bad_jobs.write_text("jobs:\n  - {name: a, model: llama3-8b, tokens: lots, global_batch: 8}\n")
    assert main(["check", str(bad_jobs)]) == 2
    _check_message(capsys.readouterr().err, ["jobs[0].tokens"])


SIM = [
    "simulate",
    "--model",
    "gpt3-175b",
    "--cluster",
    "dgx-h100",
    "--gpus",
    "64",
    "--tp",
    "8",
    "--pp",
    "8",
    "--global-batch",
    "16",
    "--micro-batch",
    "1",
]

ARG_CASES = [
    # Found by trying: --repeats 0 ended in statistics.StatisticsError, --seq-len -5 in a torch error per shape,
    # --passes 0 measured nothing and said so only by an empty file.
    (["calibrate", "profile", "--repeats", "0", "--out", "x"], ["--repeats", "expected a whole number >= 1", "'0'"]),
    (["calibrate", "profile", "--seq-len", "-5", "--out", "x"], ["--seq-len", "expected a whole number >= 1"]),
    (["calibrate", "host", "--warmup", "-1"], ["--warmup", "expected a whole number >= 0, got '-1'"]),
    (["calibrate", "profile", "--tp", "1,0", "--out", "x"], ["--tp", ">= 1, got '0' in '1,0'", "e.g. 1,2,4"]),
    (["calibrate", "profile", "--micro-batch", ",", "--out", "x"], ["--micro-batch", "comma-separated whole numbers"]),
    (["calibrate", "fit", "x.csv", "--out", "t.yaml", "--holdout", "two"], ["--holdout", "expected a whole number"]),
    # --seq-len 0 was read as "the model's default" (a falsy value), not as the bad input it is.
    (["graph", "--model", "llama3-8b", "--seq-len", "0"], ["--seq-len/--micro-batch", "must be >= 1, got 0"]),
    (
        ["simulate", "--model", "gpt3-176b", "--cluster", "dgx-h100", "--global-batch", "8"],
        ["model 'gpt3-176b'", "not a built-in model", "did you mean 'gpt3-175b'?"],
    ),
    (
        ["simulate", "--model", "gpt3-175b", "--cluster", "dgx-h10", "--global-batch", "8"],
        ["cluster 'dgx-h10'", "did you mean 'dgx-h100'?"],
    ),
    ([*SIM, "--precision", "fp4"], ["precision", "must be one of fp16, bf16, fp8", "'fp4'"]),
    ([*SIM, "--recompute", "partial"], ["recompute", "must be one of none, selective, full"]),
    ([*SIM, "--zero", "4"], ["zero_stage", "must be <= 3, got 4"]),
    (
        [
            "simulate",
            "--model",
            "gpt3-175b",
            "--cluster",
            "dgx-h100",
            "--gpus",
            "60",
            "--tp",
            "8",
            "--global-batch",
            "8",
        ],
        ["gpus", "must be a multiple of tp·pp·cp: gpus=60"],
    ),
    ([*SIM, "--set", "cluster.nics_per_nod=4"], ["nics_per_nod", "did you mean 'nics_per_node'?"]),
    ([*SIM, "--set", "clustr.nics_per_node=4"], ["--set clustr.nics_per_node=4", "unknown scope 'clustr'"]),
    ([*SIM, "--set", "nics=4"], ["--set nics=4", "scope.key=value"]),
    ([*SIM, "--set", "device.hbm_bandwidth_gb_per_s=fast"], ["hbm_bandwidth_gb_per_s", "must be a number"]),
    # Found by fuzzing: each was a traceback (ValueError, AttributeError, RecursionError) from the YAML reader.
    ([*SIM, "--set", "model.seq_len=2001-13-45"], ["--set model.seq_len", "YAML cannot read (month must be"]),
    ([*SIM, "--set", "model.seq_len=!!int abc"], ["--set model.seq_len", "YAML cannot read"]),
    ([*SIM, "--set", "model.seq_len=!!timestamp x"], ["--set model.seq_len", "YAML cannot read"]),
    ([*SIM, "--set", "model.layers=" + "9" * 5000], ["--set model.layers", "more than 4,300 digits"]),
    ([*SIM, "--set", "model.layers=" + "[" * 1000], ["--set model.layers", "nested too deeply"]),
    ([*SIM, "--set", "model.seq_len=1:30"], ["seq_len", "'1:30'"]),
    ([*SIM, "--train-tokens", "1e999999999999"], ["--train-tokens", "is not a token count"]),
    (
        ["graph", "--model", "llama3-8b", "--seq-len", str(2**53), "--micro-batch", str(2**53)],
        ["tokens per micro-batch", "must be at most 2**53"],
    ),
    (["check", "a\x00b"], ["a\\x00b", "embedded null byte"]),
    (["simulate", "--model", "gpt3-175b", "--cluster", "dgx-h100", "--tp", "8"], ["--global-batch", "required"]),
    (
        ["simulate", "--model", "gpt3-175b", "--cluster", "dgx-h100", "--gpus", "0", "--global-batch", "8"],
        ["command line: gpus", "must be >= 1, got 0"],
    ),
    (
        ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "8", "--attention", "fused"],
        ["attention", "(did you mean 'unfused'?)"],
    ),
    (
        ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "8", "--cp-comm", "ring"],
        ["cp_comm", "'ring'", "p2p, all_gather, a2a"],
    ),
    (
        ["simulate", "--model", "gpt3-175b", "--cluster", "dgx-h100", "--tp", "x", "--global-batch", "8"],
        ["argument --tp", "invalid int value"],
    ),
    (["graph", "--model", "nope"], ["model 'nope'", "not a built-in model"]),
    (["hardware", "show", "H100"], ["hardware show H100", "did you mean dgx-h100 or H100-SXM5-80GB?"]),
    (["validate", "no-such-file.csv"], ["no-such-file.csv", "file not found"]),
    # Spelling distance alone offered dgx-v100 for dgx-a100; the names the word begins are the ones meant.
    (
        ["simulate", "--model", "gpt3-175b", "--cluster", "dgx-a100", "--global-batch", "8"],
        ["cluster 'dgx-a100'", "(did you mean 'dgx-a100-40g' or 'dgx-a100-80g'?)"],
    ),
    (
        ["simulate", "--model", "gpt3-175b", "--cluster", "dgxa100-80g", "--global-batch", "8"],
        ["(did you mean 'dgx-a100-80g'?)"],
    ),
    ([*SIM, "--sched", "1f1b"], ["unrecognized arguments: --sched (did you mean '--schedule'?) 1f1b"]),
    # Interleaving without a pipeline once deadlocked the engine; then it was an infeasible answer (exit 3) while
    # the same contradiction the other way (interleaved, vp 1) was bad input. Megatron-LM refuses both at startup.
    ([*SIM, "--pp", "1", "--vp", "4"], ["vp: must be 1 without pipeline parallelism, got vp=4 with pp=1"]),
    ([*SIM, "--pp", "2", "--vp", "2", "--schedule", "gpipe"], ["vp: must be 1 with the gpipe schedule, got 2"]),
    (
        ["simulate", "--model", "gpt3-175b", "--cluster", "models/gpt3-175b.yaml", "--global-batch", "8"],
        ["gpt3-175b.yaml: is a model file (it has heads, hidden, layers), not a cluster file", "goes to --model"],
    ),
    (["calibrate", "profile", "--micro-batch", "1,5000", "--out", "x"], ["--micro-batch", "at most 1,024", "'1,5000'"]),
]


@pytest.mark.parametrize("argv", [c[0] for c in ARG_CASES], ids=[str(i) for i in range(len(ARG_CASES))])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    fragments = next(c[1] for c in ARG_CASES if c[0] == argv)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    _check_message(err, fragments)


def test_validate_rejects_csv_without_required_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "runs.csv"
    path.write_text("run_id,model\nr1,x\n")
    assert main(["validate", str(path)]) == 2
    fragments = ["runs.csv", "missing column(s)", "layers", "the header has: run_id, model"]
    _check_message(capsys.readouterr().err, fragments)


PUBLISHED = Path(__file__).resolve().parents[2] / "data" / "validation" / "published_runs.csv"


def _first_runs(n: int = 2) -> list[str]:
    return PUBLISHED.read_text().splitlines()[: n + 1]


BAD_CSVS = {
    # Every row one field longer than the header: pandas used to make run_id the index, then a traceback.
    "all-rows-long": (lambda rows: [rows[0]] + [r + ",x" for r in rows[1:]], ["line 2 has 36 fields, the header 35"]),
    "one-row-long": (lambda rows: [*rows[:2], rows[2] + ",x"], ["Expected 35 fields in line 3, saw 36", "quote"]),
    "header-only": (lambda rows: rows[:1], ["has a header but no rows", "below the header"]),
    # Column names are read without regard to case, so these two would be one.
    "name-twice": (
        lambda rows: [rows[0] + ",Model"] + [r + ",x" for r in rows[1:]],
        ["names column(s) model more than once", "keep one"],
    ),
    # Found by trying: pandas renamed an exactly repeated name to "tp.1" and the first tp silently won.
    "same-name-twice": (
        lambda rows: [rows[0] + ",tp"] + [r + ",8" for r in rows[1:]],
        ["names column(s) tp more than once", "keep one"],
    ),
    # Found by trying: a ';' header over ',' rows gave every row an invalid reason quoting the whole line.
    "header-semicolons-rows-commas": (
        lambda rows: [rows[0].replace(",", ";"), *rows[1:]],
        ["the header is separated by ';' but line 2 by ','", "one separator"],
    ),
    # ... and the other way round was not detected at all: every row said "heads: is empty".
    "header-commas-rows-semicolons": (
        lambda rows: [rows[0], *(r.replace(",", ";") for r in rows[1:])],
        ["the header is separated by ',' but line 2 by ';'", "one separator"],
    ),
    "header-tabs-rows-semicolons": (
        lambda rows: [rows[0].replace(",", "\t"), *(r.replace(",", ";") for r in rows[1:])],
        ["the header is separated by '\\t' but line 2 by ';'", "one separator"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CSVS))
def test_validate_names_what_is_wrong_with_the_csv_itself(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edit, fragments = BAD_CSVS[case]
    path = tmp_path / "runs.csv"
    path.write_text("\n".join(edit(_first_runs())) + "\n")
    assert main(["validate", str(path)]) == 2
    _check_message(capsys.readouterr().err, ["runs.csv", *fragments])


@pytest.mark.parametrize("variant", ["semicolons", "tabs", "spaced-header", "bom-crlf", "capitals-spaced-cells"])
def test_validate_reads_spreadsheet_exports_of_the_same_columns(
    variant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Semicolon- or tab-separated files (spreadsheets in many locales), a header with spaces around the names,
    a byte-order mark with CRLF line ends, and capitalised names with spaces around every cell give the same
    predictions as the comma file."""
    rows = list(csv.reader(io.StringIO("\n".join(_first_runs()))))
    if variant == "capitals-spaced-cells":
        rows = [[c.upper() for c in rows[0]]] + [[f" {c} " if c else c for c in row] for row in rows[1:]]
    out = io.StringIO()
    sep = {"semicolons": ";", "tabs": "\t"}.get(variant, ",")
    writer = csv.writer(out, delimiter=sep, lineterminator="\r\n" if variant == "bom-crlf" else "\n")
    writer.writerow([f" {c} " for c in rows[0]] if variant == "spaced-header" else rows[0])
    writer.writerows(rows[1:])
    path = tmp_path / "runs.csv"
    path.write_text(("\ufeff" if variant == "bom-crlf" else "") + out.getvalue(), encoding="utf-8")
    reference = tmp_path / "ref.csv"
    reference.write_text("\n".join(_first_runs()) + "\n")
    predicted = []
    for f in (reference, path):
        assert main(["validate", str(f), "--format", "json", "--no-stacks"]) == 0
        predicted.append([r["predicted_step_time_s"] for r in json.loads(capsys.readouterr().out)["rows"]])
    assert predicted[0] == predicted[1]
    assert len(predicted[0]) == 2


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--tp", "7", "--gpus", "7"], "'tp' must divide 'heads': tp=7, heads=96"),
        (
            ["--tp", "8", "--gpus", "64", "--global-batch", "12", "--micro-batch", "1"],
            "'global_batch' must be a multiple of dp·micro_batch",
        ),
        # A mistyped GPU count said only that 1536 is not a multiple of dp=15625000000.
        (["--tp", "8", "--gpus", "128"], "dp=16 data-parallel replicas for a global batch of 8 sequences"),
    ],
)
def test_impossible_plans_exit_3(extra: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A plan that cannot run is an answer (the reason on the table's infeasible line), exit 3."""
    argv = ["simulate", "--model", "gpt3-175b", "--cluster", "dgx-h100", "--global-batch", "8", *extra]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 3
    assert "infeasible: " in captured.out
    assert fragment in captured.out
    assert "Traceback" not in captured.out + captured.err


# -- plan files, --set values, HF configs given to --model, output paths (issue 2: bad files and arguments) ---

PLAN_CASES = [
    ("tpp: 8\nglobal_batch: 8\n", ["plan.yaml + command line: tpp", "unknown key (did you mean 'tp'?)"]),
    ("tp: 8\ntp: 4\nglobal_batch: 8\n", ["plan.yaml: line 2", "duplicate key 'tp' (first defined on line 1)"]),
    ("tp: 8\nglobal_batch: 8e3\n", ["global_batch", "text '8e3'", "exponent notation"]),
    ('tp: "8"\nglobal_batch: 8\n', ["tp: must be a whole number, got the text '8'", "remove the quotes: write 8"]),
    ("tp: 8\nglobal_batch: 8\nschedule: interleave\n", ["schedule", "(did you mean 'interleaved'?)"]),
    ("tp: 8\nglobal_batch: 8\nrecompute: yes\n", ["recompute", "must be one of none, selective, full"]),
    ("tp: 8\nglobal_batch: 8\nzero_stage: 5\n", ["zero_stage", "must be <= 3, got 5"]),
    ("tp: 8\nglobal_batch: 8\ngrad_overlap: 1\n", ["grad_overlap", "must be true or false, got 1"]),
    ("- tp: 8\n", ["plan.yaml", "must be a mapping of plan keys"]),
    ("tp: [8\n", ["plan.yaml: line", "not valid YAML"]),
]


@pytest.mark.parametrize(("content", "fragments"), PLAN_CASES, ids=[f"plan{i}" for i in range(len(PLAN_CASES))])
def test_bad_plan_files_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, fragments: list[str]
) -> None:
    """Issue 2 (bad files): a bad ``--plan`` YAML is answered with where, what and fix, exit 2."""
    (tmp_path / "plan.yaml").write_text(content)
    argv = ["simulate", "--model", "gpt3-175b", "--cluster", "dgx-h100", "--gpus", "64"]
    code = main([*argv, "--plan", str(tmp_path / "plan.yaml")])
    err = capsys.readouterr().err
    assert code == 2, err
    _check_message(err, fragments)


SET_CASES = [
    (["--set", "plan.tp=abc"], ["command line: tp", "must be a whole number, got the text 'abc'"]),
    (["--set", "plan.tpp=2"], ["tpp", "unknown key (did you mean 'tp'?)"]),
    (["--set", "model.layrs=4"], ["--set model.* overrides", "layrs", "(did you mean 'layers'?)"]),
    (["--set", "model.heads=7"], ["--set model.* overrides", "'heads' must divide 'hidden'"]),
    (["--set", "model.kv_heads=5"], ["kv_heads", "'kv_heads' must divide 'heads': heads=96, kv_heads=5"]),
    (["--set", "model.moe.top_k=2"], ["--set model.moe.top_k", "'moe' is not a mapping"]),
    (["--set", "cluster.nics_per_node=-1"], ["--set cluster.* overrides", "nics_per_node", "must be >= 1, got -1"]),
    (["--set", "cluster.nics_per_node=4.5"], ["nics_per_node", "must be a whole number, got 4.5"]),
    (["--set", "device.hbm_gib=1e3"], ["--set device.* overrides", "hbm_gib", "text '1e3'", "exponent"]),
    (["--set", "device.peak_tflops_bf16=0"], ["peak_tflops_bf16", "must be > 0, got 0"]),
    (["--set", "devce.hbm_gib=80"], ["--set devce.hbm_gib=80", "unknown scope 'devce' (did you mean 'device'?)"]),
    (["--set", "cluster=4"], ["--set cluster=4", "must look like scope.key=value"]),
]


@pytest.mark.parametrize("extra", [c[0] for c in SET_CASES], ids=[c[0][1] for c in SET_CASES])
def test_bad_set_options_exit_2(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 2 (bad arguments): ``--set`` with a bad scope, key or value names it, says why, exits 2."""
    fragments = next(c[1] for c in SET_CASES if c[0] == extra)
    code = main([*SIM, *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    _check_message(err, fragments)


def test_bad_hf_config_given_to_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 2 (bad files): an HF config.json passed to ``--model`` is checked like any model file, and the
    error names the config's own key (num_key_value_heads), not the spec's."""
    cfg = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 5,
        "num_hidden_layers": 2,
        "intermediate_size": 11008,
        "vocab_size": 32000,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code = main(["simulate", "--model", str(tmp_path / "config.json"), "--cluster", "dgx-h100", "--global-batch", "8"])
    err = capsys.readouterr().err
    assert code == 2
    _check_message(err, ["config.json: num_key_value_heads", "'kv_heads' must divide 'heads'"])


HF_CHECK_CASES = [
    ({"model_type": "llama", "num_attention_heads": 32}, ["config.json: hidden_size", "is required but missing"]),
    (
        {
            "model_type": "mixtral",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "vocab_size": 100,
            "num_local_experts": 8,
        },
        ["num_experts_per_tok", "is required but missing"],
    ),
    (
        {"model_type": "gpt2", "n_embd": "768", "n_layer": 12, "n_head": 12, "vocab_size": 50257},
        ["n_embd", "must be a whole number, got the text '768'"],
    ),
    (
        {
            "model_type": "llama",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "vocab_size": 100,
            "hidden_act": "tanh",
        },
        ["hidden_act", "unsupported activation 'tanh'"],
    ),
    ([1, 2], ["config.json", "expected a mapping"]),
]


@pytest.mark.parametrize("cfg", [c[0] for c in HF_CHECK_CASES], ids=[f"hf{i}" for i in range(len(HF_CHECK_CASES))])
def test_check_rejects_bad_hf_configs(cfg: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 2 (bad files): ``check config.json`` reports missing keys, wrong types and unsupported values."""
    fragments = next(c[1] for c in HF_CHECK_CASES if c[0] == cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code = main(["check", str(tmp_path / "config.json")])
    err = capsys.readouterr().err
    assert code == 2, err
    _check_message(err, fragments)


@pytest.mark.parametrize("option", ["--trace", "--out"])
def test_unwritable_output_exits_2(option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 2 (bad arguments): an output path in a missing folder is bad input (exit 2), not a traceback."""
    target = str(tmp_path / "missing" / "out.file")
    if option == "--trace":
        argv = [*SIM, "--recompute", "full", "--trace", target]
    else:
        csv = Path(__file__).resolve().parents[2] / "data" / "validation" / "published_runs.csv"
        rows = csv.read_text().splitlines()
        (tmp_path / "few.csv").write_text("\n".join(rows[:2]) + "\n")
        argv = ["validate", str(tmp_path / "few.csv"), "--out", target]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    _check_message(err, [f"{option} {target}", "cannot be written", "check the folder"])


def test_directory_given_as_a_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 2 (bad arguments): a folder where a CSV is expected is reported, not a traceback."""
    assert main(["validate", str(tmp_path)]) == 2
    _check_message(capsys.readouterr().err, [str(tmp_path), "is a directory"])


@pytest.mark.parametrize(
    ("content", "left"),
    [
        ("tp: 8\npp: 2\nglobal_batch: 16\n", "dp or gpus"),
        ("tp: 8\nglobal_batch: 16\ngpus: 64\n", None),
        ("dp: 4\nglobal_batch: 8\n", None),
        ("tp: 8\ngpus: 64\nmicro_batch: 2\n", "global_batch"),
        ("tp: 2\n", "global_batch, dp or gpus"),
    ],
)
def test_check_accepts_plan_files_that_leave_knobs_to_the_command_line(
    content: str, left: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 2: a plan file that leaves dp and gpus to ``simulate --gpus`` is valid for ``check`` (found by
    this test: check assumed 1 GPU and rejected tp=8), and so is one that leaves the global batch to
    ``--global-batch`` (found by an output audit: simulate accepted what check refused); check says what is left."""
    (tmp_path / "plan.yaml").write_text(content)
    assert main(["check", str(tmp_path / "plan.yaml")]) == 0
    out = capsys.readouterr().out
    assert ("(plan)" in out) if left is None else (f"(plan; left to the command line: {left})" in out)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("tp: 8\ngpus: 32\nglobal_batch: 10\nmicro_batch: 1\n", "a multiple of dp·micro_batch (4·1 = 4)"),
        ("dp: 4\nglobal_batch: 12\nmicro_batch: 2\n", "a multiple of dp·micro_batch (4·2 = 8)"),
        ("dp: 4\nglobal_batch: 10\n", "a multiple of dp (4)"),
        ("dp: 16\nglobal_batch: 8\n", "a multiple of dp (16)"),
        ("dp: 4\nglobal_batch: 8\nmicro_batch: 2\n", None),
        ("dp: 4\nglobal_batch: 12\n", None),
    ],
)
def test_check_says_a_plan_file_whose_batch_cannot_split_cannot_run(
    content: str, problem: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """check had said ok to a plan whose global batch is no multiple of dp·micro_batch, which simulate then judged
    unable to run (exit 3): check says so and exits as simulate would."""
    (tmp_path / "plan.yaml").write_text(content)
    code = main(["check", str(tmp_path / "plan.yaml")])
    out, err = capsys.readouterr()
    if problem is None:
        assert code == 0
        assert "cannot run" not in out + err
    else:
        assert code == 3
        assert "plan.yaml: the plan cannot run: global_batch" in err
        assert f"must be {problem}" in err


def test_internal_error_is_a_message_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A failed post-run invariant (a simulator defect) is reported in one line with exit 1."""
    import simulator.run
    from simulator.errors import SimulatorError

    def broken(*_args: object, **_kwargs: object) -> None:
        raise SimulatorError("pipeline deadlock: 3 tasks never ran")

    monkeypatch.setattr(simulator.run, "simulate", broken)
    code = main(["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: internal check failed: pipeline deadlock")
    assert "Traceback" not in err


def test_validate_reports_every_row_and_exits_2_when_a_cell_is_bad(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad cell is reported in its row (file, row, column, value, fix), the rest still predicted; exit 2."""
    src = Path(__file__).resolve().parents[2] / "data" / "validation" / "published_runs.csv"
    lines = src.read_text().splitlines()
    header = lines[0].split(",")
    col = header.index("measured_step_time_s")
    rows = list(csv.reader(io.StringIO("\n".join(lines[:3]))))
    rows[2][col] = "fast"
    out_csv = io.StringIO()
    csv.writer(out_csv, lineterminator="\n").writerows(rows)
    path = tmp_path / "two.csv"
    path.write_text(out_csv.getvalue())
    assert main(["validate", str(path), "--no-stacks"]) == 2
    captured = capsys.readouterr()
    assert "line 3 (" in captured.out
    assert "measured_step_time_s: must be a number of seconds of at least 1e-06, got 'fast'" in captured.out
    assert "predicted 1, infeasible 0, invalid 1" in captured.out
    assert "1 row(s) could not be read" in captured.err
    assert "Traceback" not in captured.out + captured.err


def test_an_output_that_cannot_be_written_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by trying: ``calibrate import-vidur --out`` under a path that is a file raised NotADirectoryError.
    Any file error a command does not check itself is answered with the path and the reason, exit 2."""
    blocker = tmp_path / "file.txt"
    blocker.write_text("")
    net = Path(__file__).resolve().parents[2] / "data" / "calibration" / "vidur" / "network" / "h100_dgx"
    code = main(["calibrate", "import-vidur", str(net / "all_reduce.csv"), "--out", str(blocker / "rows.csv")])
    assert code == 2
    _check_message(capsys.readouterr().err, [str(blocker), "cannot be read or written", "check the path"])


def test_validate_names_the_file_line_of_a_bad_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by trying: after blank lines (or a quoted line break) the reported row number was not the line of
    the file the row is on. A cell with a line break stays on one line of the table."""
    rows = list(csv.reader(io.StringIO("\n".join(_first_runs(2)))))
    header = rows[0]
    rows[1][header.index("model")] = "GPT\n1.7B"
    rows[2][header.index("layers")] = "abc"
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerow(rows[1])  # lines 2-3: a quoted line break
    out.write("\n\n")  # lines 4-5: blank
    writer.writerow(rows[2])  # line 6
    path = tmp_path / "gaps.csv"
    path.write_text(out.getvalue())
    assert main(["validate", str(path), "--no-stacks"]) == 2
    table = capsys.readouterr().out
    assert f"gaps.csv: line 6 ({rows[2][0]}): layers: must be a whole number, got 'abc'; fix the cell" in table
    assert "GPT 1.7B" in table
    assert main(["validate", str(path), "--no-stacks", "--format", "json"]) == 2
    reasons = [r["reason"] for r in json.loads(capsys.readouterr().out)["rows"]]
    assert reasons[1].count("gaps.csv") == 1  # named once, not once per layer of the reader


def test_validate_names_a_file_that_cannot_be_read(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by trying: a read error without a file name (an I/O error) printed 'a file' instead of the path."""
    mem = Path("/proc/self/mem")
    if not mem.exists():
        pytest.skip("needs /proc")
    assert main(["validate", str(mem)]) == 2
    assert capsys.readouterr().err.startswith("error: /proc/self/mem: cannot be read (")


def test_check_goes_by_a_files_keys_before_its_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model YAML kept in a folder named calibration/ was checked as a calibration table."""
    path = tmp_path / "calibration" / "my-model.yaml"
    path.parent.mkdir()
    path.write_text(GOOD_MODEL)
    assert main(["check", str(path)]) == 0
    assert "(model)" in capsys.readouterr().out


def test_validate_refuses_to_write_over_the_stacks_file_it_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out named the software_stacks.yaml next to the CSV, which validate reads unasked: the results replaced it,
    and the next run failed on it. Found by a review of ``validate``."""
    path = tmp_path / "runs.csv"
    path.write_text(
        "\n".join((ROOT / "data" / "validation" / "published_runs.csv").read_text().splitlines()[:2]) + "\n"
    )
    stacks = tmp_path / "software_stacks.yaml"
    stacks.write_text((ROOT / "data" / "validation" / "software_stacks.yaml").read_text())
    before = stacks.read_text()
    assert main(["validate", str(path), "--out", str(stacks)]) == 2
    _check_message(capsys.readouterr().err, ["--out", "is the stacks file this run reads"])
    assert stacks.read_text() == before
    assert main(["validate", str(path), "--no-stacks", "--out", str(stacks)]) == 0  # not read: the user's to replace


def test_graph_bounds_its_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    """--seq-len 10**400 raised OverflowError; 10**20 printed a garbled table."""
    for size in (str(10**400), str(10**20)):
        assert main(["graph", "--model", "llama3-8b", "--seq-len", size]) == 2
        _check_message(capsys.readouterr().err, ["--seq-len", "at most 2**53"])


def test_validate_refuses_to_write_over_its_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "runs.csv"
    path.write_text((ROOT / "data" / "validation" / "published_runs.csv").read_text().splitlines()[0] + "\n")
    before = path.read_text()
    assert main(["validate", str(path), "--out", str(path)]) == 2
    _check_message(capsys.readouterr().err, ["--out", "is the input CSV"])
    assert path.read_text() == before


def test_validate_reads_a_pipe() -> None:
    """`cat runs.csv | clustersim validate /dev/stdin` read the header twice from a stream that cannot rewind
    ("a row has more fields than the header's 0")."""
    import subprocess
    import sys

    text = "\n".join(_first_runs(1)) + "\n"
    done = subprocess.run(
        [sys.executable, "-m", "simulator.cli", "validate", "/dev/stdin", "--format", "json"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"]["rows"] == 1


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        # The flag won for gpus and --set won for ep: contradictions are now refused either way.
        (["--gpus", "16", "--set", "plan.gpus=32"], "--set plan.gpus: says 32 where the flag for gpus says 16"),
        (["--gpus", "16", "--tp", "2", "--set", "plan.tp=4"], "--set plan.tp: says 4 where the flag for tp says 2"),
        # 'auto' contradicts a value too; case does not make a contradiction (see the agreeing case below)
        (
            ["--gpus", "8", "--micro-batch", "4", "--set", "plan.micro_batch=auto"],
            "--set plan.micro_batch: says 'auto'",
        ),
    ],
)
def test_a_knob_given_twice_with_two_values_is_refused(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "32"]
    assert main([*base, *argv]) == 2
    _check_message(capsys.readouterr().err, [fragment, "give the value once"])
    assert main([*base, "--gpus", "16", "--set", "plan.gpus=16", "--format", "json"]) in (0, 3)  # agreeing is fine
    capsys.readouterr()
    assert main([*base, "--gpus", "16", "--precision", "bf16", "--set", "plan.precision=BF16"]) in (0, 3)
    capsys.readouterr()


def test_validate_refuses_stacks_and_no_stacks_together(capsys: pytest.CaptureFixture[str]) -> None:
    stacks = ROOT / "data" / "validation" / "software_stacks.yaml"
    assert main(["validate", str(PUBLISHED), "--stacks", str(stacks), "--no-stacks"]) == 2
    _check_message(capsys.readouterr().err, ["--stacks/--no-stacks", "give one of them"])


def test_a_plan_file_cannot_leave_a_fixed_degree_to_auto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """'tp: auto' was read as tp 1 and reported ok; 'auto' frees only what the simulator chooses or derives."""
    bad = tmp_path / "plan.yaml"
    bad.write_text("tp: auto\nglobal_batch: 32\n")
    assert main(["check", str(bad)]) == 2
    _check_message(capsys.readouterr().err, ["tp: is 'auto'", "does not choose tp", "the default (1)"])
    for text, key in (
        ("recompute: full\nrecompute_layers: auto\n", "recompute_layers"),
        ("tp_overlap: auto\n", "tp_overlap"),
    ):
        bad.write_text(text + "global_batch: 32\n")  # had been read as every layer, and as off, unreported
        assert main(["check", str(bad)]) == 2
        _check_message(capsys.readouterr().err, [f"{key}: is 'auto'", f"does not choose {key}"])
    bad.write_text("micro_bach: auto\nglobal_batch: 32\n")  # a misspelt key set to auto was dropped silently
    assert main(["check", str(bad)]) == 2
    _check_message(capsys.readouterr().err, ["micro_bach: unknown key (did you mean 'micro_batch'?)"])
    good = tmp_path / "free.yaml"
    for dp in ("free", "null", "auto"):
        good.write_text(f"micro_batch: auto\nrecompute: auto\ndp: {dp}\nglobal_batch: 32\n")
        assert main(["check", str(good)]) == 0
        assert "left to the command line: dp or gpus" in capsys.readouterr().out


def test_hardware_show_suggests_clusters_too(capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped cluster name was answered with the list of devices only."""
    assert main(["hardware", "show", "dgx-h10"]) == 2
    _check_message(capsys.readouterr().err, ["did you mean dgx-h100", "gb200-nvl72", "H100-SXM5-80GB"])


def test_calibrate_names_are_plain_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """calibrate host --name ../../x wrote x.yaml outside --out."""
    assert main(["calibrate", "host", "--device", "cpu", "--name", "../../x", "--out", str(tmp_path)]) == 2
    _check_message(capsys.readouterr().err, ["--name '../../x': must be a plain name"])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("command", [["profile", "--configs", "tiny"], ["host", "--device", "cpu"]])
def test_calibrate_out_folder_that_is_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """profile and host --out an existing file failed after planning (host: after announcing 510 shapes) with
    'Not a directory'; it is refused first, saying --out is a folder."""
    afile = tmp_path / "afile"
    afile.write_text("keep")
    for out in (afile, afile / "sub"):
        assert main(["calibrate", *command, "--out", str(out)]) == 2
        _check_message(capsys.readouterr().err, [f"{afile} is a file", "--out names a folder"])
    assert afile.read_text() == "keep"


def test_validate_reads_semicolons_with_cr_only_line_endings(tmp_path: Path) -> None:
    """Older Excel for Mac saves CR-only line endings; the header was taken to be the whole file."""
    rows = list(csv.reader(io.StringIO("\n".join(_first_runs(1)) + "\n")))
    out = io.StringIO()
    csv.writer(out, delimiter=";", lineterminator="\r").writerows(rows)
    path = tmp_path / "runs.csv"
    path.write_text(out.getvalue(), newline="")
    assert main(["validate", str(path), "--format", "json"]) == 0


def test_a_long_row_is_named_by_the_line_it_starts_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A record with quoted line breaks was named by its last line."""
    header, first = _first_runs(1)
    cells = next(csv.reader([first]))
    cells[cells.index(next(c for c in cells if c.startswith("S0")))] = "a\nmulti-line\nsource"
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow([*cells, "x"])
    path = tmp_path / "runs.csv"
    path.write_text(header + "\n" + out.getvalue())
    assert main(["validate", str(path)]) == 2
    assert "line 2 has 36 fields" in capsys.readouterr().err


def test_an_output_that_is_an_input_or_another_output_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model YAML given as --trace was replaced by the trace, an nccl-tests file given as --out by the rows read
    from it, a stacks file by validate's rows, and --device-out equal to --out left only the device profile where the
    table was reported written: each is refused before anything runs, and the inputs are left as they were."""
    import shutil

    root = Path(__file__).resolve().parents[2]
    model = tmp_path / "m.yaml"
    shutil.copy(root / "models" / "mpt-7b.yaml", model)
    nccl = tmp_path / "ar.txt"
    shutil.copy(root / "data" / "calibration" / "vtrain" / "a100_all_reduce_2gpu.txt", nccl)
    stacks = tmp_path / "stacks.yaml"
    stacks.write_text("stacks: []\n")
    before = {p: p.read_bytes() for p in (model, nccl, stacks)}
    sim = ["simulate", "--model", str(model), "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8"]
    cases = [
        ([*sim, "--trace", str(model)], f"--trace {model}: is an input of this command"),
        (["calibrate", "import-nccl-tests", str(nccl), "--out", str(nccl)], f"--out {nccl}: is an input"),
        (
            [
                "validate",
                str(root / "data" / "validation" / "published_runs.csv"),
                "--stacks",
                str(stacks),
                "--out",
                str(stacks),
            ],
            f"--out {stacks}: is an input",
        ),
        (
            [
                "calibrate",
                "fit",
                str(nccl),
                "--out",
                str(tmp_path / "t.yaml"),
                "--device-out",
                str(tmp_path / "t.yaml"),
            ],
            "is also --device-out",
        ),
    ]
    for argv, says in cases:
        assert main(argv) == 2, argv
        assert says in capsys.readouterr().err
    assert {p: p.read_bytes() for p in before} == before
    assert not (tmp_path / "t.yaml").exists()


def test_abbreviated_options_and_a_mistyped_plan_key_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a CLI review: '--global 8' was read as '--global-batch 8' (argparse's prefix matching), and a plan
    file's 'global_bach: 1536' was reported as a missing --global-batch flag instead of the typo it is."""
    base = ["simulate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "--gpus", "8"]
    assert main([*base, "--global-batch", "8", "--global", "16"]) == 2
    assert "unrecognized arguments: --global (did you mean '--global-batch'?) 16" in capsys.readouterr().err
    plan = tmp_path / "plan.yaml"
    plan.write_text("tp: 8\nglobal_bach: 1536\n")
    assert main([*base, "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "global_bach: unknown key (did you mean 'global_batch'?)" in err
    assert "Traceback" not in err


def test_a_utf16_validation_csv_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a CLI review: Excel's "Unicode text" (UTF-16) decoded as UTF-8 was one field per line, reported as
    'line 2 has 1 fields, the header 35'."""
    rows = (ROOT / "data" / "validation" / "published_runs.csv").read_text().splitlines()[:2]
    path = tmp_path / "runs.csv"
    path.write_text("\n".join(rows) + "\n", encoding="utf-16")
    assert main(["validate", str(path)]) == 2
    assert "is UTF-16 text, not UTF-8; save the file as UTF-8" in capsys.readouterr().err


def test_fit_refuses_an_output_that_is_a_file_it_reads_inside_an_input_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`calibrate fit prof --device-out prof/kernels.csv` replaced the profile's own measurements with the device
    profile: the guard compared outputs with the paths given, not with the files fit reads inside a folder. Every
    file fit would read (the folder's measurement CSVs, its manifest and failures) is refused as an output; other
    files in the folder are not. Found by a review of the calibration workflow."""
    from simulator.calibration.rows import Measurement, write_rows

    prof = tmp_path / "prof"
    rows = [
        Measurement(kind="collective", op="all_reduce", bytes=2.0 ** (20 + i), ranks=8, scope="domain",
                    time_s=2.0 ** (20 + i) / 1e11)
        for i in range(6)
    ]  # fmt: skip
    write_rows(rows, prof / "sub" / "collectives.csv")
    (prof / "manifest.json").write_text('{"shapes": {}}\n')
    (prof / "notes.yaml").write_text("kept: yes\n")
    before = {p: p.read_bytes() for p in prof.rglob("*") if p.is_file()}
    fit = ["calibrate", "fit", str(prof), "--device", "A100-SXM4-80GB", "--out", str(tmp_path / "t.yaml")]
    for target in (prof / "sub" / "collectives.csv", prof / "manifest.json"):
        assert main([*fit, "--device-out", str(target)]) == 2
        assert f"error: --device-out {target}: is an input of this command" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in prof.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "t.yaml").exists()
    assert main([*fit, "--device-out", str(prof / "notes.yaml")]) == 0  # a file fit does not read may be replaced
