"""Sharing a cluster among jobs: the side-by-side makespan is the least any choice of planned counts gives."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.cli import main
from simulator.errors import SpecError
from simulator.search.jobs import Job, JobPlan, _replanned, _side_by_side, schedule_jobs
from simulator.specs import load_cluster, load_model

ROOT = Path(__file__).resolve().parents[2]


@st.composite
def _tables(draw: st.DrawFn) -> tuple[dict[str, list[JobPlan]], int]:
    gpus = draw(st.sampled_from([16, 32, 64]))
    jobs = draw(st.integers(1, 4))
    table: dict[str, list[JobPlan]] = {}
    for j in range(jobs):
        counts = draw(st.lists(st.sampled_from([8, 16, 24, 32, 48, 64]), min_size=1, max_size=4, unique=True))
        counts = [c for c in counts if c <= gpus] or [8]
        table[f"j{j}"] = [JobPlan(f"j{j}", c, None, draw(st.floats(0.1, 50.0))) for c in sorted(counts)]
    return table, gpus


@settings(max_examples=200, deadline=None)
@given(_tables())
def test_side_by_side_finds_the_least_makespan_of_all_choices(case: tuple[dict[str, list[JobPlan]], int]) -> None:
    table, gpus = case
    names = sorted(table)
    best = math.inf
    for combo in itertools.product(*(table[n] for n in names)):
        if sum(p.gpus for p in combo) <= gpus:
            best = min(best, max(p.days for p in combo))
    chosen, days = _side_by_side(names, table, gpus)
    assert days == best
    if chosen:
        assert sum(p.gpus for p in chosen) <= gpus
        assert [p.job for p in chosen] == names
        assert max(p.days for p in chosen) == days


@settings(max_examples=200, deadline=None)
@given(_tables())
def test_replanning_trains_every_job_whole_never_overbooks_and_never_ends_later(
    case: tuple[dict[str, list[JobPlan]], int],
) -> None:
    table, gpus = case
    names = sorted(table)
    side, side_days = _side_by_side(names, table, gpus)
    if not side:
        return
    phases, days = _replanned(names, table, gpus)
    assert days <= side_days * (1 + 1e-9)
    for n in names:
        mine = [ph for ph in phases if ph.plan.job == n]
        # Each job trains all of its tokens: the fractions of its work its phases did add up to one.
        assert sum((ph.end - ph.start) / ph.plan.days for ph in mine) == pytest.approx(1.0, rel=1e-9)
        # Its phases follow one another without a gap, from the start.
        assert mine[0].start == 0.0
        assert all(a.end == pytest.approx(b.start) for a, b in itertools.pairwise(mine))
    assert max(ph.end for ph in phases) == pytest.approx(days)
    for ph in phases:  # at every phase's start, the phases then running fit in the cluster
        t = ph.start
        assert sum(q.plan.gpus for q in phases if q.start <= t < q.end) <= gpus


def test_two_jobs_on_64_h100s_both_schedules_and_the_better_one() -> None:
    cluster = load_cluster("dgx-h100")
    jobs = [
        Job("a", load_model("llama3-8b"), 100e9, 256, {"tp": 1, "pp": 1, "zero_stage": 1}),
        Job("b", load_model("llama2-7b"), 50e9, 256, {"tp": 1, "pp": 1, "zero_stage": 1}),
    ]
    found = schedule_jobs(jobs, cluster, 64)
    assert {p.gpus for p in found.plans if p.job == "a"} == {8, 16, 32, 48, 56, 64}
    serial = found.one_after_another
    assert [p.job for p in serial] == ["a", "b"]
    assert found.one_after_another_days == pytest.approx(sum(p.days for p in serial))
    # Each alone at its fastest count, and the training time is whole steps at the simulated step time.
    for p in serial:
        assert p.days == min(q.days for q in found.plans if q.job == p.job)
        steps = math.ceil(next(j for j in jobs if j.name == p.job).tokens / (256 * p.result.plan.seq_len))
        assert p.days == pytest.approx(steps * p.result.step_time_s / 86400)
    assert sum(p.gpus for p in found.side_by_side) <= 64
    # Side by side gives llama2-7b the 16 GPUs llama3-8b cannot use (it had left them idle: a review); re-planned,
    # llama3-8b then takes all 64 when llama2-7b is done, and beats one after another (2.41 days).
    assert [(p.job, p.gpus) for p in found.side_by_side] == [("a", 32), ("b", 32)]
    assert [(ph.plan.job, ph.plan.gpus) for ph in found.replanned] == [("a", 32), ("b", 32), ("a", 64)]
    assert found.replanned_days < found.one_after_another_days < found.side_by_side_days
    assert found.best == "replanned"
    assert found.idle_gpu_days("replanned") == pytest.approx(0.0, abs=1e-9)
    schedules = ("side_by_side", "replanned", "one_after_another")
    assert found.best == min(schedules, key=lambda w: (found.days(w), schedules.index(w)))
    assert found.idle_gpu_days("one_after_another") == pytest.approx(
        sum(64 * p.days - p.gpu_days for p in serial), abs=1e-9
    )


def test_a_job_that_fits_nowhere_is_reported_and_the_rest_scheduled() -> None:
    cluster = load_cluster("dgx-h100")
    jobs = [
        Job("big", load_model("llama3-70b"), 1e9, 8, {"zero_stage": 0, "tp": 8, "pp": 1}),
        Job("small", load_model("llama3-8b"), 1e9, 8, {"tp": 1, "pp": 1, "zero_stage": 1}),
    ]
    found = schedule_jobs(jobs, cluster, 8)
    assert [j for j, _ in found.unplanned] == ["big"]
    assert "no layout fits" in found.unplanned[0][1]
    assert [p.job for p in found.side_by_side] == ["small"]


def test_bad_job_lists_are_spec_errors() -> None:
    cluster, model = load_cluster("dgx-h100"), load_model("llama3-8b")
    with pytest.raises(SpecError, match="is empty"):
        schedule_jobs([], cluster, 8)
    with pytest.raises(SpecError, match="used twice"):
        schedule_jobs([Job("a", model, 1e9, 8), Job("a", model, 1e9, 8)], cluster, 8)
    with pytest.raises(SpecError, match="more than the cluster"):
        schedule_jobs([Job("a", model, 1e9, 8)], cluster, 8, counts=[16])


def test_the_cli_reads_a_jobs_file_and_answers_the_same_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(ROOT / "analysis" / "schedules" / "two_llamas.yaml")
    assert main(["schedule", path, "--format", "json", "--workers", "1"]) == 0
    first = capsys.readouterr().out
    assert main(["schedule", path, "--format", "json", "--workers", "2"]) == 0
    assert capsys.readouterr().out == first
    assert main(["schedule", path]) == 0
    table = capsys.readouterr().out
    assert table.startswith("2 jobs on 64 GPUs of dgx-h100\nbest: ")
    assert "side by side" in table
    assert "one after another" in table


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("jobs: []\n", "jobs: must be a list of one job or more"),
        ("jobs:\n  - {name: a, model: llama3-8b, tokens: 1T}\n", "jobs[0].global_batch: is required"),
        (
            "jobs:\n  - {name: a, model: llama3-8b, tokens: 1X, global_batch: 8}\n",
            "jobs[0].tokens '1X': is not a token",
        ),
        ("jobs:\n  - {name: a, model: llama3-8b, tokens: 1T, global_batch: 8, plan: {dp: 2}}\n", "plan.dp: is set by"),
        (
            "jobs:\n  - {name: a, model: llama3-8b, tokens: 1T, global_batch: 8, plan: {global_batch: 8}}\n",
            "give it as jobs[0].global_batch, beside plan",
        ),
        ("jobs:\n  - {name: a, model: llama3-8b, tokens: 1T, global_batch: 8, gpu: 2}\n", "jobs[0].gpu: unknown key"),
        ("jobz: []\n", "and the file has 'jobz'; rename 'jobz' to 'jobs'"),
        # Found by a review: each was a traceback-free but wrong answer (exit 3, a doubled location, a nonsense fix).
        (
            "jobs:\n  - {name: a, model: llama3-8b, tokens: 1T, global_batch: 8, min_gpus: 16, max_gpus: 8}\n",
            "jobs[0].max_gpus: must be >= min_gpus 16, got 8",
        ),
        (
            "jobs:\n  - {name: a, model: llama3-8b, tokens: 1T, global_batch: 8, plan: {tp: []}}\n",
            "jobs[0].plan.tp: is an empty list",
        ),
        (
            "jobs:\n  - {name: a, model: llama3-8b, tokens: 1T, global_batch: 8, plan: {1: 2}}\n",
            "jobs[0].plan.1: is no plan key (a int)",
        ),
        ("jobs:\n  - {name: a, model: 7, tokens: 1T, global_batch: 8}\n", ".yaml: jobs[0].model: must be a non-empty"),
        (
            "jobs:\n  - {name: a, model: llama3-8b, tokens: 1T, global_batch: 8}\n"
            "  - {name: a, model: llama3-8b, tokens: 1T, global_batch: 8}\n",
            "jobs[1].name: 'a' is also jobs[0]'s name",
        ),
    ],
)
def test_bad_jobs_files_are_exit_2_with_the_key_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, said: str
) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text("cluster: dgx-h100\ngpus: 8\n" + body, encoding="utf-8")
    assert main(["schedule", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert said in err
    assert err.count("jobs.yaml") <= 1  # the location once


@pytest.mark.parametrize(
    ("flag", "value", "said"), [("--gpus", "0", "--gpus: must be >= 1"), ("--cluster", " ", "--cluster: is empty")]
)
def test_a_flag_given_empty_or_zero_is_not_replaced_by_the_file(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, said: str
) -> None:
    """--gpus 0 had been read as 'not given' and the file's gpus used (a review)."""
    path = str(ROOT / "analysis" / "schedules" / "two_llamas.yaml")
    assert main(["schedule", path, flag, value]) == 2
    assert said in capsys.readouterr().err


def test_when_no_job_can_run_there_is_no_best_schedule_and_no_zero_days(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """JSON had said best side_by_side, 0 days, while the table said not possible (a review)."""
    path = tmp_path / "jobs.yaml"
    path.write_text(
        "cluster: dgx-a100-80g\ngpus: 16\njobs:\n  - {name: a, model: llama3-8b, tokens: 1B, global_batch: 16, "
        "plan: {precision: fp8, tp: 1, pp: 1, zero_stage: 1}}\n",
        encoding="utf-8",
    )
    assert main(["schedule", str(path), "--format", "json", "--workers", "1"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["best"] is None
    assert data["side_by_side"]["days"] is None
    assert data["one_after_another"]["days"] is None
    # The reason names every count tried and the cause (precision), not a count of layouts alone.
    why = data["unplanned"][0]["reason"]
    assert "on 8 GPUs" in why
    assert "on 16 GPUs" in why
    assert "FP8 tensor cores" in why


def test_schedules_within_rounding_tie_and_idle_time_is_never_negative() -> None:
    """Re-planned rebuilds side by side's end from its phases, one rounding step off (6.119999999999999 against
    6.12): it had been named best over the same schedule, and a cluster busy to the end had -3.55e-15 GPU-days idle
    (a review)."""
    from simulator.search.jobs import Schedule

    a, b = JobPlan("a", 8, None, 6.12), JobPlan("b", 8, None, 1.47)
    phases, days = _replanned(["a", "b"], {"a": [a], "b": [b]}, 16)
    assert days != 6.12  # the rounding this guards against
    found = Schedule("c", 16, ("a", "b"), (a, b), (a, b), 6.12, (a, b), 7.59, (), phases, days)
    assert found.best == "side_by_side"
    full = JobPlan("a", 24, None, 0.1 + 0.2)
    busy = Schedule("c", 24, ("a",), (full,), (full,), 0.30000000000000004, (full,), 0.3, ())
    assert busy.idle_gpu_days("side_by_side") >= 0.0
    assert busy.idle_gpu_days("one_after_another") >= 0.0


def test_a_count_a_fixed_knob_does_not_suit_is_a_reason_not_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tp 8 on 12 GPUs cannot lay out, while 8 GPUs can: the whole schedule had stopped with exit 2 naming neither
    the file nor the job (a review)."""
    path = tmp_path / "jobs.yaml"
    path.write_text(
        "cluster: dgx-h100\ngpus: 12\njobs:\n"
        "  - {name: a, model: llama3-8b, tokens: 1B, global_batch: 8, plan: {tp: 8, pp: 1, zero_stage: 0}}\n",
        encoding="utf-8",
    )
    assert main(["schedule", str(path), "--format", "json", "--workers", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_count = {p["gpus"]: p for p in data["plans"]}
    assert by_count[8]["days"] is not None
    assert by_count[12]["days"] is None
    assert "on 12 GPUs: layouts" in by_count[12]["reason"]
    assert "must divide" in by_count[12]["reason"]


def test_replanned_phases_in_json_and_table_describe_the_phase(capsys: pytest.CaptureFixture[str]) -> None:
    """Each phase's days and GPU-days had been the whole job's at that count (a review); short phases read 0.41 to
    0.41 in the table, now with their hours."""
    path = str(ROOT / "analysis" / "schedules" / "two_llamas.yaml")
    assert main(["schedule", path, "--format", "json", "--workers", "1"]) == 0
    data = json.loads(capsys.readouterr().out)["replanned"]
    for ph in data["phases"]:
        assert ph["days"] == pytest.approx(ph["end_days"] - ph["start_days"])
        assert ph["gpu_days"] == pytest.approx(ph["gpus"] * ph["days"])
    used = sum(ph["gpu_days"] for ph in data["phases"])
    assert used + data["idle_gpu_days"] == pytest.approx(64 * data["days"])
    assert main(["schedule", path, "--workers", "1"]) == 0
    assert " h)" in capsys.readouterr().out


def test_a_bad_cluster_in_the_file_is_named_with_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(
        "cluster: dgx-h1000\ngpus: 8\njobs:\n  - {name: a, model: llama3-8b, tokens: 1B, global_batch: 8}\n",
        encoding="utf-8",
    )
    assert main(["schedule", str(path)]) == 2
    assert "jobs.yaml: cluster: " in capsys.readouterr().err
