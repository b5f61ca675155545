"""Bad files and arguments: every one answered with ``error: <where>: <what>; <fix>`` and exit 2, no traceback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from simulator.cli import main

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
        ["compute[0].efficiency[1]", "(0, 1]"],
    ),
    ("hf.json", '{"model_type": "t5", "d_model": 512}', ["hf.json: model_type", "unsupported model_type 't5'"]),
    ("bad.json", '{"model_type": "llama",', ["bad.json", "not valid JSON"]),
]


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
    (["simulate", "--model", "gpt3-175b", "--cluster", "dgx-h100", "--tp", "8"], ["--global-batch", "required"]),
    (
        ["simulate", "--model", "gpt3-175b", "--cluster", "dgx-h100", "--tp", "x", "--global-batch", "8"],
        ["argument --tp", "invalid int value"],
    ),
    (["graph", "--model", "nope"], ["model 'nope'", "not a built-in model"]),
    (["hardware", "show", "H100"], ["device 'H100'", "not a built-in device"]),
    (["validate", "no-such-file.csv"], ["no-such-file.csv", "file not found"]),
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
    _check_message(capsys.readouterr().err, ["runs.csv", "missing column(s)", "layers"])


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--tp", "7", "--gpus", "7"], "'tp' must divide 'heads': tp=7, heads=96"),
        (
            ["--tp", "8", "--gpus", "64", "--global-batch", "12", "--micro-batch", "1"],
            "'global_batch' must be a multiple of dp·micro_batch",
        ),
    ],
)
def test_impossible_plans_exit_3(extra: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--model", "gpt3-175b", "--cluster", "dgx-h100", "--global-batch", "8", *extra]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 3
    assert fragment in err
    assert "Traceback" not in err
