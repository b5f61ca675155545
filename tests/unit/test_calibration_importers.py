"""Importers on the shipped public data (data/calibration/) and on small nccl-tests and Kineto samples."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from simulator.calibration.fit import compute_class, fit_table
from simulator.calibration.importers.nccl_tests import import_nccl_tests, import_vtrain_table
from simulator.calibration.importers.torch_profiler import import_torch_trace
from simulator.calibration.importers.vidur import import_vidur_compute, import_vidur_network
from simulator.cost.communication import bus_factor
from simulator.errors import CalibrationError
from simulator.specs.library import load_device

DATA = Path(__file__).resolve().parents[2] / "data" / "calibration"

NCCL_OUTPUT = """\
# nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20
# Collective test starting: all_reduce_perf
#  Rank  0 Group  0 Pid  1 on node-a device  0 [0x07] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  2 on node-a device  1 [0x0f] NVIDIA H100 80GB HBM3
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     1048576        262144     float     sum      -1    20.00   52.43   52.43      0    19.80   52.96   52.96      0
   134217728      33554432     float     sum      -1   420.00  319.57  319.57      0   419.00  320.33  320.33      0
"""


def test_vidur_a100_compute_rows_are_physical() -> None:
    rows = import_vidur_compute(DATA / "vidur" / "compute" / "a100" / "Llama-2-7b-hf" / "mlp.csv")
    gemms = [r for r in rows if r.kind == "gemm"]
    assert len(gemms) > 100
    assert any(r.kind == "memory" for r in rows)
    peak = load_device("A100-SXM4-80GB").peak("fp16")
    best = max(r.flops / r.time_s for r in gemms)
    assert 0.5 * peak < best < peak  # large fp16 GEMMs reach 50-100% of the A100's 312 TFLOP/s


def test_vidur_network_rows_have_scope_and_sizes() -> None:
    rows = import_vidur_network(DATA / "vidur" / "network" / "a100_dgx" / "all_reduce.csv")
    domain = [r for r in rows if r.scope == "domain" and r.ranks == 8]
    assert domain
    big = max(domain, key=lambda r: r.bytes)
    busbw = big.bytes / big.time_s * bus_factor("all_reduce", 8)
    assert 100e9 < busbw < 300e9  # NVLink 3 all-reduce bus bandwidth on a DGX A100


def _broken_copy(src: Path, dst: Path, line: int, old: str, new: str) -> Path:
    lines = src.read_text().splitlines()
    assert old in lines[line - 1]
    lines[line - 1] = lines[line - 1].replace(old, new, 1)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("\n".join(lines) + "\n")
    return dst


def test_malformed_vidur_files_name_the_line_column_and_value(tmp_path: Path) -> None:
    """Found by fuzzing: a text cell, an empty file or an unknown collective in a Vidur CSV raised ValueError,
    TypeError or KeyError from pandas; each is now a CalibrationError that says where and what."""
    mlp = DATA / "vidur" / "compute" / "a100" / "Llama-2-7b-hf" / "mlp.csv"
    header = mlp.read_text().splitlines()[0].split(",")
    col = header.index("num_tokens")
    cells = mlp.read_text().splitlines()[2].split(",")
    cells[col] = "12x"
    bad = tmp_path / "compute" / "a100" / "m" / "mlp.csv"
    bad.parent.mkdir(parents=True)
    bad.write_text("\n".join([",".join(header), mlp.read_text().splitlines()[1], ",".join(cells)]) + "\n")
    with pytest.raises(
        CalibrationError,
        match="line 3, column 'num_tokens': expected a whole number from 1 to 1099511627776, got '12x'",
    ):
        import_vidur_compute(bad)
    # Found by fuzzing: 'inf' parsed as a number and raised OverflowError; a fraction or a negative count was
    # truncated silently.
    for value in ("inf", "2.5", "-4", "0"):
        cells[col] = value
        bad.write_text("\n".join([",".join(header), ",".join(cells)]) + "\n")
        with pytest.raises(CalibrationError, match=f"line 2, column 'num_tokens': .* got '{re.escape(value)}'"):
            import_vidur_compute(bad)
    empty = tmp_path / "empty" / "x" / "mlp.csv"
    empty.parent.mkdir(parents=True)
    empty.write_text("")
    with pytest.raises(CalibrationError, match="cannot read as CSV"):
        import_vidur_compute(empty)
    net = DATA / "vidur" / "network" / "a100_dgx" / "all_reduce.csv"
    broken = _broken_copy(net, tmp_path / "network" / "a100_dgx" / "all_reduce.csv", 2, "all_reduce", "allreduce")
    with pytest.raises(CalibrationError, match="line 2, column 'collective': 'allreduce' has no"):
        import_vidur_network(broken)


def test_vtrain_table_matches_its_documented_check() -> None:
    rows = import_vtrain_table(DATA / "vtrain" / "a100_all_reduce_8gpu.txt")
    gib = next(r for r in rows if r.bytes == 2**30)
    assert gib.ranks == 8
    assert gib.time_s == pytest.approx(8.2e-3, rel=0.05)
    table = fit_table(rows, load_device("A100-SXM4-80GB"), name="vtrain")
    assert table.collectives[0].collective == "all_reduce"


def test_nccl_tests_output(tmp_path: Path) -> None:
    path = tmp_path / "all_reduce.txt"
    path.write_text(NCCL_OUTPUT)
    rows = import_nccl_tests(path)
    assert [r.op for r in rows] == ["all_reduce", "all_reduce"]
    assert rows[0].ranks == 2
    assert rows[0].scope == "domain"
    assert rows[0].device == "NVIDIA H100 80GB HBM3"
    assert rows[1].time_s == pytest.approx(420e-6)
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(CalibrationError, match="no nccl-tests data lines"):
        import_nccl_tests(tmp_path / "empty.txt")
    (tmp_path / "unnamed.txt").write_text(NCCL_OUTPUT.replace("# Collective test starting: all_reduce_perf\n", ""))
    with pytest.raises(CalibrationError, match="line 6: cannot tell which collective"):
        import_nccl_tests(tmp_path / "unnamed.txt")


def test_nccl_tests_lines_nccl_tests_found_wrong_or_negative_are_dropped_with_a_note(tmp_path: Path) -> None:
    """A line with #wrong > 0 (nccl-tests' own check found corrupted results) was fitted like any other, and a
    negative size was skipped without a word: both are dropped and named."""
    lines = NCCL_OUTPUT.splitlines()
    broken = lines[-1].replace(" 0   419.00", " 3   419.00")  # out-of-place #wrong 3
    negative = lines[-2].replace("     1048576", "    -1048576")
    path = tmp_path / "all_reduce.txt"
    path.write_text("\n".join([*lines[:-2], negative, broken]) + "\n")
    notes: list[str] = []
    assert import_nccl_tests(path, notes=notes) == []
    assert notes == [
        f"{path}: dropped 1 data line(s) with a zero or negative size or time (nothing to fit): line 7",
        f"{path}: dropped 1 data line(s) with #wrong > 0 (nccl-tests found wrong results: a broken run): line 8",
    ]


def test_collective_times_too_short_for_any_fabric_are_a_unit_error(tmp_path: Path) -> None:
    """128 MiB in 0.42 ns (nanoseconds written where nccl-tests has microseconds) made a table whose all-reduces ran
    at 300 PB/s; vTrain's nanoseconds read as picoseconds the same."""
    path = tmp_path / "all_reduce.txt"
    path.write_text(NCCL_OUTPUT.replace("   420.00  319.57", "     0.00042  319.57"))
    with pytest.raises(CalibrationError, match=r"line 8: 134217728 bytes in 4.2e-10 s is 3.2e\+05 TB/s.*microseconds"):
        import_nccl_tests(path)
    src = (DATA / "vtrain" / "a100_all_reduce_8gpu.txt").read_text().splitlines()
    cells = src[-1].split(",")
    cells[3] = "0.001"
    table = tmp_path / "a100_all_reduce_8gpu.txt"
    table.write_text("\n".join([*src[:-1], ",".join(cells)]) + "\n")
    with pytest.raises(CalibrationError, match=f"line {len(src)}: .* nanoseconds"):
        import_vtrain_table(table)
    assert import_vtrain_table(DATA / "vtrain" / "a100_all_reduce_8gpu.txt")  # the real table passes


def test_nccl_tests_output_with_two_runs_gives_each_its_collective_and_group(tmp_path: Path) -> None:
    """A job log running all_reduce_perf on 2 GPUs, then all_gather_perf on 2 nodes: rank lines used to be
    counted over the whole file (4 ranks for both) and the last test's name given to every row."""
    second = (
        NCCL_OUTPUT.replace("all_reduce_perf", "all_gather_perf")
        .replace("Rank  1 Group  0 Pid  2 on node-a", "Rank  1 Group  0 Pid  2 on node-b")
        .replace("sum", "none")
    )
    path = tmp_path / "job.log"
    path.write_text(NCCL_OUTPUT + second)
    rows = import_nccl_tests(path)
    assert [(r.op, r.ranks, r.scope) for r in rows] == [
        ("all_reduce", 2, "domain"),
        ("all_reduce", 2, "domain"),
        ("all_gather", 2, "network"),
        ("all_gather", 2, "network"),
    ]
    assert rows[2].host == "node-a,node-b"
    # The hosts of one GB200 NVL72 rack share an NVLink domain: the caller says so, and the rows are fitted.
    assert {r.scope for r in import_nccl_tests(path, scope="domain")} == {"domain"}


def test_torch_profiler_cpu_trace(tmp_path: Path) -> None:
    events = [
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100, "args": {"Input Dims": [[64, 128], [128, 256]],
         "Input type": ["c10::BFloat16", "c10::BFloat16"], "External id": 1}},
        {"cat": "cpu_op", "name": "aten::gelu", "ts": 200, "dur": 10, "args": {"Input Dims": [[64, 256]],
         "Input type": ["c10::BFloat16"], "External id": 2}},
    ]  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows = import_torch_trace(path, device="cpu")
    gemm = next(r for r in rows if r.kind == "gemm")
    assert (gemm.m, gemm.k, gemm.n, gemm.precision) == (64, 128, 256, "bf16")
    assert gemm.time_s == pytest.approx(100e-6)
    path.write_text("not json")
    with pytest.raises(CalibrationError, match="Chrome trace"):
        import_torch_trace(path)


def test_torch_profiler_kernels_of_unread_operators_inside_attention_are_attention(tmp_path: Path) -> None:
    """PyTorch's flash SDPA launches its kernel from aten::_flash_attention_forward inside
    aten::_scaled_dot_product_flash_attention: the kernel's External id names the inner operator, which the importer
    does not read, so every flash attention kernel of a GPU trace was dropped. A cast kernel under aten::linear is
    not charged to the GEMM."""
    bf16 = ["c10::BFloat16"] * 3
    qkv = [[2, 4, 1024, 64]] * 3
    events = [
        {"cat": "cpu_op", "name": "aten::_scaled_dot_product_flash_attention", "ts": 0, "dur": 50, "pid": 1,
         "tid": 1, "args": {"Input Dims": qkv, "Input type": bf16, "Concrete Inputs": ["", "", "", "0.", "True"],
         "External id": 1}},
        {"cat": "cpu_op", "name": "aten::_flash_attention_forward", "ts": 10, "dur": 30, "pid": 1, "tid": 1,
         "args": {"Input Dims": qkv, "External id": 2}},
        {"cat": "kernel", "name": "flash_fwd_kernel", "ts": 100, "dur": 80, "args": {"External id": 2}},
        {"cat": "cpu_op", "name": "aten::linear", "ts": 60, "dur": 30, "pid": 1, "tid": 1,
         "args": {"Input Dims": [[64, 128], [256, 128], [256]], "Input type": bf16, "External id": 3}},
        {"cat": "cpu_op", "name": "aten::to", "ts": 62, "dur": 3, "pid": 1, "tid": 1, "args": {"External id": 4}},
        {"cat": "kernel", "name": "cast_kernel", "ts": 200, "dur": 7, "args": {"External id": 4}},
        {"cat": "cpu_op", "name": "aten::addmm", "ts": 66, "dur": 20, "pid": 1, "tid": 1,
         "args": {"Input Dims": [[256], [64, 128], [128, 256]], "Input type": bf16, "External id": 5}},
        {"cat": "kernel", "name": "sm90_gemm", "ts": 210, "dur": 11, "args": {"External id": 5}},
    ]  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows = {r.op: r.time_s for r in import_torch_trace(path, device="NVIDIA H100")}
    assert rows == {"flash2_sdpa_causal_fwd": pytest.approx(80e-6), "aten::addmm": pytest.approx(11e-6)}


def test_torch_profiler_cpu_trace_times_an_operator_once_not_also_its_wrapper(tmp_path: Path) -> None:
    """On a CPU trace aten::linear (dispatch, a transpose and the addmm inside it) was a second GEMM row of the same
    shape, and aten::layer_norm a second row of native_layer_norm's work: the inner operator is the measurement."""
    bf16 = ["c10::BFloat16"] * 3
    events = [
        {"cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 1680, "pid": 1, "tid": 1,
         "args": {"Input Dims": [[64, 128], [256, 128], [256]], "Input type": bf16}},
        {"cat": "cpu_op", "name": "aten::addmm", "ts": 460, "dur": 1218, "pid": 1, "tid": 1,
         "args": {"Input Dims": [[256], [64, 128], [128, 256]], "Input type": bf16}},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 700, "dur": 41, "pid": 1, "tid": 1,
         "args": {"Input Dims": [[64, 256], [256]], "Input type": bf16}},
        # Another thread's operator overlapping in time is not nested in the linear.
        {"cat": "cpu_op", "name": "aten::mm", "ts": 100, "dur": 50, "pid": 1, "tid": 2,
         "args": {"Input Dims": [[64, 128], [128, 256]], "Input type": bf16}},
        {"cat": "cpu_op", "name": "aten::layer_norm", "ts": 2000, "dur": 90, "pid": 1, "tid": 1,
         "args": {"Input Dims": [[64, 256], [256], [256], []], "Input type": bf16}},
        {"cat": "cpu_op", "name": "aten::native_layer_norm", "ts": 2010, "dur": 70, "pid": 1, "tid": 1,
         "args": {"Input Dims": [[64, 256], [256], [256], []], "Input type": bf16}},
    ]  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows = sorted((r.op, round(r.time_s * 1e6)) for r in import_torch_trace(path, device="cpu"))
    # addmm keeps its own time, the bias copy inside it included (no row of its own: its time is addmm's)
    assert rows == [("aten::addmm", 1218), ("aten::mm", 50), ("aten::native_layer_norm", 70)]


GPU_TRACE = [
    {"cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 50, "args": {"Input Dims": [[64, 128], [256, 128], [256]],
     "Input type": ["c10::BFloat16"] * 3, "External id": 1}},
    {"cat": "cpu_op", "name": "aten::addmm", "ts": 5, "dur": 40, "args": {"Input Dims": [[256], [64, 128], [128, 256]],
     "Input type": ["c10::BFloat16"] * 3, "External id": 1}},
    {"cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 100, "dur": 30, "args": {"External id": 1}},
    {"cat": "cpu_op", "name": "aten::gelu", "ts": 60, "dur": 20, "args": {"Input Dims": [[64, 256]],
     "Input type": ["c10::BFloat16"], "External id": 2}},
    # No External id on the kernel: attributed to the operator whose span contains its start.
    {"cat": "kernel", "name": "vectorized_elementwise_kernel", "ts": 70, "dur": 4, "args": {}},
    {"cat": "cpu_op", "name": "record_param_comms", "ts": 90, "dur": 5, "args": {"In msg nelems": 1048576,
     "dtype": "BFloat16", "Group size": 8, "External id": 3}},
    {"cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*)", "ts": 200, "dur": 120,
     "args": {"External id": 3}},
]  # fmt: skip
# Malformed copies of those events, as a hand-edited or truncated trace might hold them (found by fuzzing: each
# raised AttributeError, TypeError or OverflowError). They are skipped.
MALFORMED = [
    {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9, "args": [1, 2]},
    {"cat": "cpu_op", "name": 7, "ts": 0, "dur": 9},
    {"cat": "cpu_op", "name": "aten::mm", "ts": None, "dur": 9},
    {"cat": "kernel", "name": "k", "ts": 1, "dur": float("inf")},
    {"cat": "kernel", "name": "k", "ts": 1, "dur": 3, "args": {"External id": [1]}},
    {"cat": "cpu_op", "name": "aten::bmm", "ts": 400, "dur": 9, "args": {"Input Dims": "x", "Input type": [[1]]}},
    {"cat": "cpu_op", "name": "aten::mm", "ts": 500, "dur": 9, "args": {"Input Dims": [[-5, 3], [3, "x"]]}},
    {"cat": "cpu_op", "name": "record_param_comms", "ts": 600, "dur": 1, "args": {"In msg nelems": "1e400",
     "Group size": [8], "External id": 9}},
    {"cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 601, "dur": 5, "args": {"External id": 9}},
]  # fmt: skip


def test_torch_profiler_gpu_trace_attributes_kernels_and_skips_malformed_events(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": GPU_TRACE, "deviceProperties": [{"name": "NVIDIA H100"}]}))
    rows = import_torch_trace(path)
    gemm = next(r for r in rows if r.kind == "gemm")
    assert (gemm.op, gemm.m, gemm.k, gemm.n) == ("aten::addmm", 64, 128, 256)  # the innermost operator
    assert gemm.time_s == pytest.approx(30e-6)  # the kernel's time, not the operator's CPU span
    assert gemm.device == "NVIDIA H100"
    gelu = next(r for r in rows if r.op == "aten::gelu")
    assert gelu.time_s == pytest.approx(4e-6)
    comm = next(r for r in rows if r.kind == "collective")
    assert (comm.op, comm.bytes, comm.ranks) == ("all_reduce", 2.0 * 2**20, 8)
    path.write_text(json.dumps({"traceEvents": GPU_TRACE + MALFORMED, "deviceProperties": "x"}))
    assert [(r.op, r.time_s) for r in import_torch_trace(path, device="NVIDIA H100")] == [
        (r.op, r.time_s) for r in rows
    ]
    path.write_text(json.dumps({"traceEvents": MALFORMED[:5]}))
    with pytest.raises(CalibrationError, match="5 operator/kernel events unreadable"):
        import_torch_trace(path)


@pytest.mark.torch
def test_torch_profiler_real_kineto_trace(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    w = torch.randn(128, 256, dtype=torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.nn.functional.gelu(torch.mm(x, w))
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    rows = import_torch_trace(path, device="cpu")
    gemm = next(r for r in rows if r.kind == "gemm")
    assert (gemm.m, gemm.k, gemm.n) == (64, 128, 256)
    assert any(r.kind == "memory" and "gelu" in r.op for r in rows)


def test_torch_profiler_sizes_collectives_as_whole_buffers_in_their_recorded_dtype(tmp_path: Path) -> None:
    """nccl-tests and the tables size an all-gather by its gathered output and a reduce-scatter by its full input;
    record_param_comms writes the dtype as c10::toString does ("Float" for fp32)."""

    def comm(ext: int, kernel: str, ins: int, outs: int, dtype: str) -> list[dict[str, object]]:
        args = {"In msg nelems": ins, "Out msg nelems": outs, "dtype": dtype, "Group size": 8, "External id": ext}
        return [
            {"cat": "cpu_op", "name": "record_param_comms", "ts": 10 * ext, "dur": 1, "args": args},
            {"cat": "kernel", "name": kernel, "ts": 10 * ext + 1, "dur": 50 + ext, "args": {"External id": ext}},
        ]

    events = [
        *comm(1, "ncclDevKernel_AllGather_RING_LL", 2**20, 8 * 2**20, "BFloat16"),
        *comm(2, "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 8 * 2**20, 2**20, "Float"),
        *comm(3, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 2**20, 2**20, "Float"),
        *comm(4, "ncclDevKernel_AllReduce_Sum_c64_RING_LL", 2**20, 2**20, "ComplexFloat"),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    notes: list[str] = []
    rows = {r.op: r.bytes for r in import_torch_trace(path, device="NVIDIA H100", notes=notes)}
    assert rows == {"all_gather": 16 * 2**20, "reduce_scatter": 32 * 2**20, "all_reduce": 4 * 2**20}
    assert any("1 NCCL kernel(s) without a message size" in n and "known dtype" in n for n in notes)


def test_torch_profiler_collectives_across_nodes_are_scoped_network(tmp_path: Path) -> None:
    """Every NCCL kernel of a trace was filed as scope domain, so a data-parallel all-reduce between two nodes
    (ranks 0 and 8 under torchrun on 8-GPU hosts) fitted as NVLink bandwidth would have slowed every NVLink
    collective to the network's pace. The ranks and the host's GPUs now place the group; the caller can override."""

    def comm(ext: int, args: dict[str, object]) -> list[dict[str, object]]:
        full = {"In msg nelems": 2**20 * ext, "dtype": "BFloat16", "Group size": 2, "External id": ext, **args}
        return [
            {"cat": "cpu_op", "name": "record_param_comms", "ts": 10 * ext, "dur": 1, "args": full},
            {"cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ts": 10 * ext + 1, "dur": 50,
             "args": {"External id": ext}},
        ]  # fmt: skip

    events = [
        *comm(1, {"Process Group Ranks": "[0, 8]"}),  # a dp pair across two nodes
        *comm(2, {"Process Group Ranks": [0, 1]}),  # a tp pair inside one
        *comm(3, {"Global rank start": 0, "Global rank stride": 8}),  # older traces: start and stride
        *comm(4, {}),  # nothing recorded: inside one domain, with a note
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events, "deviceProperties": [{"name": "NVIDIA H100"}] * 8}))
    notes: list[str] = []
    scopes = {r.bytes / 2**21: r.scope for r in import_torch_trace(path, notes=notes)}
    assert scopes == {1: "network", 2: "domain", 3: "network", 4: "domain"}
    assert any("1 NCCL kernel(s) taken to run inside one NVLink domain" in n and "--scope network" in n for n in notes)
    assert {r.scope for r in import_torch_trace(path, scope="domain")} == {"domain"}
    # One GPU visible per process (srun binding): ranks cannot be placed on nodes, so the group is assumed, as noted.
    path.write_text(json.dumps({"traceEvents": events, "deviceProperties": [{"name": "NVIDIA H100"}]}))
    assert {r.scope for r in import_torch_trace(path)} == {"domain"}


@pytest.mark.torch
def test_torch_profiler_reads_the_causal_mask_of_attention_from_a_real_kineto_trace(tmp_path: Path) -> None:
    """SDPA with is_causal=True: the rows fit the causal curves, with the mask's halved FLOPs, forward and
    backward (the CPU backend; on a GPU the flash backend's rows are named flash2_ and fit FlashAttention-2's)."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(2, 4, 64, 32, requires_grad=True) for _ in range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    rows = {r.op: r for r in import_torch_trace(path, device="cpu") if r.kind == "attention"}
    assert set(rows) == {"sdpa_causal_fwd", "sdpa_causal_bwd"}
    full = 4.0 * 2 * 4 * 64 * 64 * 32
    assert rows["sdpa_causal_fwd"].flops == pytest.approx(full / 2)
    assert rows["sdpa_causal_bwd"].flops == pytest.approx(2.5 * full / 2)
    assert {compute_class(r) for r in rows.values()} == {"attention_causal", "attention_causal_bwd"}


def test_nccl_tests_runs_in_the_order_nccl_tests_prints_them(tmp_path: Path) -> None:
    """nccl-tests prints "Collective test starting" before the "# nThread" header; the second run had been split
    off its name ("cannot tell which collective"), or named after the file."""
    lines = NCCL_OUTPUT.splitlines(keepends=True)
    real = lines[1] + lines[0] + "".join(lines[2:])  # starting line first
    second = real.replace("all_reduce_perf", "all_gather_perf").replace("on node-a device  1", "on node-b device  1")
    path = tmp_path / "all_reduce_perf.log"  # a file name that would mislabel the second run
    path.write_text(real + second)
    rows = import_nccl_tests(path)
    assert [(r.op, r.scope) for r in rows] == [("all_reduce", "domain")] * 2 + [("all_gather", "network")] * 2


OLD_HEADER = """\
# nThread 1 nGpus 8 minBytes 8 maxBytes 1073741824 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#   Rank  0 Pid  12345 on   node01 device  0 [0x07] Tesla V100-SXM2-32GB
#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
"""
OLD_LINES = """\
     1048576        262144   float     sum    40.00   26.21   45.88  0e+00    41.00   25.58   44.76  0e+00
   134217728      33554432   float     sum    10500   12.78   22.37  0e+00   9990.5   13.43   23.51  0e+00
  1073741824     268435456   float     sum    16000   67.11  117.44  0e+00    16001   67.10  117.43  0e+00
"""
NEW_LINES = """\
     1048576        262144     float     sum      -1    40.00   26.21   45.88      0    41.00   25.58   44.76      0
   134217728      33554432     float     sum      -1    10500   12.78   22.37      0   9990.5   13.43   23.51      0
  1073741824     268435456     float     sum      -1    16000   67.11  117.44      0    16001   67.10  117.43      0
"""


@pytest.mark.parametrize("header", [True, False])
@pytest.mark.parametrize("lines", [OLD_LINES, NEW_LINES])
def test_nccl_tests_times_printed_as_whole_numbers_are_read_with_and_without_the_root_column(
    tmp_path: Path, header: bool, lines: str
) -> None:
    """nccl-tests prints a time of 10 ms or more as a whole number ("%7.0f"). In a log older than the root column
    such a time was taken for the root (a whole number fifth) and algbw read as the time: the 1 GiB line was dropped
    as '#wrong > 0' (the in-place time 16001 read as #wrong) and the 128 MiB line refused as 10 TB/s. The layout is
    now told by the run's column header, else by the fields of its data lines (12 without the root column, 13 with
    it). Found by a review of the calibration workflow."""
    text = (OLD_HEADER if header else OLD_HEADER.splitlines(keepends=True)[0]) + lines
    if header and lines is NEW_LINES:
        text = NCCL_OUTPUT.split("     1048576", maxsplit=1)[0] + lines
    path = tmp_path / "all_reduce_perf.txt"
    path.write_text(text)
    notes: list[str] = []
    rows = import_nccl_tests(path, notes=notes)
    assert [(r.bytes, r.time_s) for r in rows] == [
        (1048576, pytest.approx(40e-6)),
        (134217728, pytest.approx(10500e-6)),
        (1073741824, pytest.approx(16000e-6)),
    ]
    assert notes == []


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (NCCL_OUTPUT + "  1073741824     268435456     float     sum      -1\n", 9),
        (NCCL_OUTPUT + "  1073741824     268435456     float\n", 9),
        (OLD_HEADER + OLD_LINES + "  2147483648     536870912   float     sum    32000   67.11\n", 8),
    ],
)
def test_nccl_tests_data_lines_cut_short_are_an_error_like_longer_cut_lines(
    tmp_path: Path, text: str, line: int
) -> None:
    """A data line cut to fewer than 8 fields (a run killed while printing it) was dropped without a word, while one
    cut after 8 fields was an error asking whether it was cut off: both are that error now. Found by a review of the
    calibration workflow."""
    path = tmp_path / "all_reduce_perf.txt"
    path.write_text(text)
    with pytest.raises(CalibrationError, match=rf"line {line}: cannot read a time .*cut off\?"):
        import_nccl_tests(path)


def test_nccl_tests_lines_of_a_job_script_are_not_data_lines(tmp_path: Path) -> None:
    """A line that starts with a number but is no data line (a job script's echo of the GPU count or a timestamp)
    had become a 'cut off?' error once short data lines were refused; a data line starts with a size and an element
    count. Found by a review of this change."""
    path = tmp_path / "all_reduce_perf.txt"
    path.write_text("8 GPUs done\n1764000000\n" + NCCL_OUTPUT)
    assert len(import_nccl_tests(path)) == len(import_nccl_tests(_write(tmp_path / "plain.txt", NCCL_OUTPUT)))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_torch_profiler_drops_gemms_on_empty_operands_with_a_note(tmp_path: Path) -> None:
    """An MoE expert that received no tokens runs aten::mm on a 0×256 operand: the importer wrote a GEMM row of 0
    FLOPs, which fit then refused, failing the whole file. Such rows (and memory rows of 0 bytes) are dropped with a
    note. Found by a review of the calibration workflow."""
    f32 = ["float", "float"]
    events = [
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100, "args": {"Input Dims": [[256, 256], [256, 256]],
         "Input type": f32}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 200, "dur": 4, "args": {"Input Dims": [[0, 256], [256, 256]],
         "Input type": f32}},
        {"cat": "cpu_op", "name": "aten::gelu", "ts": 300, "dur": 2, "args": {"Input Dims": [[0, 256]],
         "Input type": ["float"]}},
    ]  # fmt: skip
    path = tmp_path / "moe.json"
    path.write_text(json.dumps({"traceEvents": events}))
    notes: list[str] = []
    rows = import_torch_trace(path, device="cpu", notes=notes)
    assert [(r.op, r.m) for r in rows] == [("aten::mm", 256)]
    assert notes == [
        f"{path}: skipped 2 recognised operator(s) on empty tensors (no FLOPs or bytes to fit: an MoE expert that "
        "received no tokens, say)"
    ]


def test_torch_profiler_cpu_trace_does_not_count_a_copy_inside_a_gemm_twice(tmp_path: Path) -> None:
    """On a CPU trace aten::addmm's duration already holds the bias copy (aten::copy_) it runs, and a backward
    aten::mm the copy_ under its aten::clone; the copies were rows of their own as well, so their time counted
    twice. Only operators not nested inside another counted one are rows now. Found by a review of the calibration
    workflow."""
    f32 = ["float"] * 3
    events = [
        {"cat": "cpu_op", "name": "aten::addmm", "ts": 0, "dur": 500, "pid": 1, "tid": 1,
         "args": {"Input Dims": [[256], [64, 128], [128, 256]], "Input type": f32}},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 10, "dur": 40, "pid": 1, "tid": 1,
         "args": {"Input Dims": [[64, 256], [256]], "Input type": f32}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 1000, "dur": 300, "pid": 1, "tid": 1,
         "args": {"Input Dims": [[64, 256], [256, 128]], "Input type": f32}},
        {"cat": "cpu_op", "name": "aten::clone", "ts": 1010, "dur": 60, "pid": 1, "tid": 1,
         "args": {"Input Dims": [[64, 256]], "Input type": f32}},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 1020, "dur": 45, "pid": 1, "tid": 1,
         "args": {"Input Dims": [[64, 256], [64, 256]], "Input type": f32}},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 2000, "dur": 30, "pid": 1, "tid": 1,
         "args": {"Input Dims": [[64, 256], [64, 256]], "Input type": f32}},
    ]  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows = sorted((r.op, round(r.time_s * 1e6)) for r in import_torch_trace(path, device="cpu"))
    assert rows == [("aten::addmm", 500), ("aten::copy_", 30), ("aten::mm", 300)]  # the copy on its own stays


@pytest.mark.parametrize("kind", ["compute", "network"])
def test_vidur_files_outside_a_named_gpu_folder_need_device(tmp_path: Path, kind: str) -> None:
    """The device was read off the parent folder's name whatever it was: a copy of an A100 mlp.csv under
    my_run/vb3/ was imported as device 'my_run' (or '' at the root), and fit then accepted it for an H100 table.
    A folder that is not one of Vidur's device names is refused unless --device names the GPU. Found by a review of
    the calibration workflow."""
    src = (
        DATA / "vidur" / "compute" / "a100" / "Llama-2-7b-hf" / "mlp.csv"
        if kind == "compute"
        else DATA / "vidur" / "network" / "a100_dgx" / "send_recv.csv"
    )
    path = tmp_path / "my_run" / "vb3" / src.name
    path.parent.mkdir(parents=True)
    path.write_text(src.read_text())
    load = import_vidur_compute if kind == "compute" else import_vidur_network
    folder = "my_run" if kind == "compute" else "vb3"
    with pytest.raises(
        CalibrationError, match=rf"{path}: cannot tell the GPU from the folder name '{folder}'.*--device"
    ):
        load(path)
    assert {r.device for r in load(path, "A100-SXM4-80GB")} == {"A100-SXM4-80GB"}


def test_vidur_network_folders_of_other_node_kinds_name_their_gpu(tmp_path: Path) -> None:
    """Upstream Vidur also profiles a100_pair_nvlink, a100_pairwise_nvlink and h100_pair_nvlink nodes: refusing
    every folder name but a100, h100, a100_dgx and h100_dgx left such a tree with no way to import (with --device
    it is refused as holding several GPUs). The GPU is the name's first part. Found by a review of this change."""
    path = tmp_path / "network" / "h100_pair_nvlink" / "send_recv.csv"
    path.parent.mkdir(parents=True)
    path.write_text((DATA / "vidur" / "network" / "h100_dgx" / "send_recv.csv").read_text())
    assert {r.device for r in import_vidur_network(path)} == {"H100-SXM5-80GB"}


def test_vidur_folder_without_profiles_names_both_layouts(tmp_path: Path) -> None:
    """import-vidur on data/calibration/vidur/network said it expected compute/<gpu>/<model>/mlp.csv only, though
    the folder held network CSVs: the message names the network layout too. Found by a review of the calibration
    workflow."""
    from simulator.calibration.importers.vidur import import_vidur_tree

    with pytest.raises(CalibrationError, match=r"compute/<gpu>/<model>/mlp\.csv or network/<node>/\*\.csv"):
        import_vidur_tree(DATA / "vidur" / "network")


def test_imported_rows_name_their_line_so_measurements_that_agree_are_not_copies(tmp_path: Path) -> None:
    """Fit counts a row that repeats another in every column once (a file read twice, lines pasted twice). Vidur
    profiled some token counts twice, and 25 of those lines agree to the microsecond with their twin: the rows name
    the line they come from, so both measurements are kept. Found by a review of the calibration workflow."""
    from simulator.calibration.rows import read_rows, write_rows

    rows = import_vidur_compute(DATA / "vidur" / "compute" / "a100" / "Llama-2-7b-hf" / "mlp.csv")
    rows += import_vidur_network(DATA / "vidur" / "network" / "a100_dgx" / "send_recv.csv")
    rows += import_vtrain_table(DATA / "vtrain" / "a100_all_reduce_8gpu.txt")
    path = tmp_path / "all_reduce.txt"
    path.write_text(NCCL_OUTPUT + NCCL_OUTPUT.split("\n", 4)[4])  # the same data lines twice in one log
    rows += import_nccl_tests(path)
    write_rows(rows, tmp_path / "rows.csv")
    notes: list[str] = []
    assert len(read_rows([tmp_path / "rows.csv"], notes=notes)) == len(rows)
    assert notes == []
    assert rows[0].note.endswith("; line 2")
