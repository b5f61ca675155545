"""simulate --html: a self-contained report that reproduces itself, says what does not fit, and is the same bytes
for the same inputs."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest

from simulator import report
from simulator.cli import main

SIM = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--tp", "2", "--pp", "2"]
SIM += ["--global-batch", "16", "--micro-batch", "1"]


class _Tags(HTMLParser):
    """Every start tag, and the external references a self-contained page must not have."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href") and tag != "a":
                self.external.append(f"{tag} {name}={value}")


def _parse(text: str) -> _Tags:
    tags = _Tags()
    tags.feed(text)
    return tags


def test_the_report_holds_the_figures_charts_and_the_command_that_reproduces_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "step.html"
    assert main([*SIM, "--train-tokens", "1T", "--html", str(out)]) == 0
    printed = capsys.readouterr().out
    text = out.read_text(encoding="utf-8")
    tags = _parse(text)
    assert tags.tags.count("svg") == 3  # breakdown per stage, memory per stage, timeline
    assert "script" not in tags.tags
    assert not tags.external
    assert "<h1>llama3-8b on 16 GPUs of dgx-h100</h1>" in text
    step = next(line for line in printed.splitlines() if line.startswith("step time"))
    assert step.split()[2] in text  # the step time the table printed, e.g. 1.234
    assert "days to train" in text
    command = "clustersim simulate --model llama3-8b --cluster dgx-h100 --gpus 16 --tp 2 --pp 2 --global-batch 16"
    assert f"<pre>{command} --micro-batch 1 --train-tokens 1T</pre>" in text  # without --html
    assert "(chosen)" in text  # vp, recompute and grad_overlap were left free


def test_same_inputs_same_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = tmp_path / "a.html", tmp_path / "b.html"
    assert main([*SIM, "--html", str(first)]) == 0
    assert main([*SIM, "--html", str(second)]) == 0
    capsys.readouterr()
    a = first.read_text(encoding="utf-8").replace(str(first), "")
    b = second.read_text(encoding="utf-8").replace(str(second), "")
    assert a == b


def test_a_plan_that_does_not_fit_is_reported_with_the_stage_and_bytes_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "oom.html"
    argv = ["simulate", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "8", "--tp", "8"]
    argv += ["--global-batch", "8", "--micro-batch", "1", "--recompute", "none", "--html", str(out)]
    assert main(argv) == 3
    capsys.readouterr()
    text = out.read_text(encoding="utf-8")
    assert "out of memory" in text
    assert 'class="bad">stage 0 is' in text
    assert "capacity" in text


def test_a_long_timeline_is_left_out_with_a_pointer_to_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "MAX_TIMELINE_BARS", 10)
    out = tmp_path / "long.html"
    assert main([*SIM, "--html", str(out)]) == 0
    capsys.readouterr()
    text = out.read_text(encoding="utf-8")
    assert "more than a page draws well (10)" in text
    assert "--trace step.json" in text
    assert _parse(text).tags.count("svg") == 2


def test_names_are_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m.yaml"
    model.write_text(
        "name: '<script>alert(1)</script>'\nlayers: 2\nhidden: 256\nheads: 4\nffn_hidden: 1024\nvocab: 1000\n"
        "seq_len: 256\n",
        encoding="utf-8",
    )
    out = tmp_path / "esc.html"
    argv = ["simulate", "--model", str(model), "--cluster", "dgx-h100", "--gpus", "1", "--global-batch", "2"]
    assert main([*argv, "--html", str(out)]) == 0
    capsys.readouterr()
    text = out.read_text(encoding="utf-8")
    assert "<script>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text


def test_an_html_path_that_is_an_input_or_unwritable_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m.yaml"
    model.write_text(
        "name: m\nlayers: 2\nhidden: 256\nheads: 4\nffn_hidden: 1024\nvocab: 1000\nseq_len: 256\n", encoding="utf-8"
    )
    base = ["simulate", "--model", str(model), "--cluster", "dgx-h100", "--gpus", "1", "--global-batch", "2"]
    assert main([*base, "--html", str(model)]) == 2
    assert "--html" in capsys.readouterr().err
    assert model.read_text(encoding="utf-8").startswith("name: m")
    assert main([*base, "--html", str(tmp_path / "no" / "such" / "dir" / "r.html")]) == 2
    assert "error:" in capsys.readouterr().err


PLAN = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "32"]
PLAN += ["--tp", "1,2,4", "--pp", "1,2", "--zero", "1", "--top", "3"]


def test_plan_html_ranks_the_best_and_details_the_fastest_the_same_with_any_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one, two = tmp_path / "one.html", tmp_path / "two.html"
    assert main([*PLAN, "--workers", "1", "--html", str(one)]) == 0
    printed = capsys.readouterr().out
    assert main([*PLAN, "--workers", "2", "--html", str(two)]) == 0
    capsys.readouterr()
    text = one.read_text(encoding="utf-8")
    assert text == two.read_text(encoding="utf-8").replace(str(two), str(one))  # nothing of the run's timing
    assert "<h1>Fastest layouts of llama3-8b on 16 GPUs of dgx-h100</h1>" in text
    ranking = text.split("<h2>The fastest layouts</h2>", 1)[1].split("</table>", 1)[0]
    assert ranking.count("<tr>") == 1 + 3  # the heading and --top 3
    command = next(line.strip() for line in printed.splitlines() if line.strip().startswith("clustersim simulate"))
    assert f"<pre>{command}</pre>" in text
    fastest = next(line.split() for line in printed.splitlines() if line.strip().startswith("1 "))
    detail = text.split("<h2>The fastest in detail</h2>", 1)[1]
    unit = next(i for i, token in enumerate(fastest) if token in ("s", "ms"))
    step = f"{fastest[unit - 1]} {fastest[unit]}"  # e.g. 1.583 s, as the table says
    assert f"<b>{step}</b><span>step time</span>" in detail
    assert _parse(text).tags.count("svg") == 3


def test_plan_html_where_nothing_fits_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "none.html"
    argv = ["plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8"]
    assert main([*argv, "--html", str(out)]) == 3
    capsys.readouterr()
    text = out.read_text(encoding="utf-8")
    assert "0 timed" in text
    assert "<p>nothing fits; the closest is layout" in text
    assert "GiB over</p>" in text
    assert "The fastest in detail" not in text


def test_found_by_a_review(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """plan --html read its facts back from the printed table, and a model named with a newline broke that with an
    IndexError; --format json with an unwritable --html printed the whole answer, then failed; a number just under
    a power of ten came out as 1e+03; a name with a lone surrogate crashed the writer."""
    model = tmp_path / "nl.yaml"
    model.write_text(
        'name: "a\\nb"\nlayers: 2\nhidden: 256\nheads: 4\nffn_hidden: 1024\nvocab: 1000\nseq_len: 256\n',
        encoding="utf-8",
    )
    out = tmp_path / "p.html"
    argv = ["plan", "--model", str(model), "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8"]
    assert main([*argv, "--tp", "1", "--pp", "1", "--zero", "1", "--workers", "1", "--html", str(out)]) == 0
    assert "<p>searched 1 layout (tp 1 · pp 1 · cp 1 · ep 1 · zero 1): 1 timed" in out.read_text(encoding="utf-8")
    capsys.readouterr()
    folder = tmp_path / "d"
    folder.mkdir()
    assert main([*argv, "--tp", "1", "--pp", "1", "--zero", "1", "--format", "json", "--html", str(folder)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--html" in captured.err
    assert (report._num(999.7, 3), report._num(9999.7), report._num(0.00012)) == ("1,000", "10,000", "0.00012")
    bad = tmp_path / "sur.yaml"
    bad.write_text(model.read_text(encoding="utf-8").replace('"a\\nb"', '"x\\ud800y"'), encoding="utf-8")
    assert main(["simulate", "--model", str(bad), "--cluster", "dgx-h100", "--gpus", "1", "--global-batch", "2"]) == 2
    assert "no Unicode character" in capsys.readouterr().err


def test_plan_html_on_one_gpu_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A one-GPU layout had been labelled 'dp only' in the ranking (a review)."""
    model = tmp_path / "m.yaml"
    model.write_text(
        "name: m\nlayers: 2\nhidden: 256\nheads: 4\nffn_hidden: 1024\nvocab: 1000\nseq_len: 256\n", encoding="utf-8"
    )
    out = tmp_path / "one.html"
    argv = ["plan", "--model", str(model), "--cluster", "dgx-h100", "--gpus", "1", "--global-batch", "2"]
    assert main([*argv, "--workers", "1", "--html", str(out)]) == 0
    capsys.readouterr()
    ranking = out.read_text(encoding="utf-8").split("<h2>The fastest layouts</h2>", 1)[1].split("</table>", 1)[0]
    assert "<td>one GPU</td>" in ranking
    assert "dp only" not in ranking
