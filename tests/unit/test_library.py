"""The built-in library: every model, device and cluster file loads by name, and model sizes match published totals.

Parameter counts are checked against what the model's authors publish (paper tables, model cards), within 0.5%,
so a typo in a layer count or a width shows up here rather than as a silently wrong simulation.
"""

from __future__ import annotations

import re

import pytest

from simulator.specs.library import list_names, load_cluster, load_device, load_model

MODELS = list_names("model")
DEVICES = list_names("device")
CLUSTERS = list_names("cluster")

NUMBER_LINE = re.compile(r"^\s*[a-z_0-9]+:\s*-?[0-9][0-9.]*\s*(#.*)?$")


def test_library_is_populated() -> None:
    assert len(MODELS) >= 30
    assert len(DEVICES) >= 9
    assert len(CLUSTERS) >= 8


@pytest.mark.parametrize(("name", "path"), MODELS, ids=[n for n, _ in MODELS])
def test_model_loads_under_its_file_name(name: str, path) -> None:
    """Issue 2: every shipped model file loads by its name."""
    model = load_model(name)
    assert model.name == path.stem
    assert model.param_count() > 0


@pytest.mark.parametrize(("name", "path"), DEVICES, ids=[n for n, _ in DEVICES])
def test_device_loads_under_its_file_name(name: str, path) -> None:
    """Issue 2: every shipped device file loads by its name."""
    device = load_device(name)
    assert device.name == path.stem
    assert device.peak("bf16") > 0
    assert device.hbm_bytes > 0
    assert device.hbm_bandwidth_bytes_per_s > 0


@pytest.mark.parametrize(("name", "path"), CLUSTERS, ids=[n for n, _ in CLUSTERS])
def test_cluster_loads_under_its_file_name(name: str, path) -> None:
    """Issue 2: every shipped cluster file loads by its name."""
    cluster = load_cluster(name)
    assert cluster.name == path.stem
    assert cluster.nvlink_domain_gpus % cluster.gpus_per_node == 0


@pytest.mark.parametrize(("name", "path"), MODELS + DEVICES + CLUSTERS, ids=[n for n, _ in MODELS + DEVICES + CLUSTERS])
def test_every_number_cites_a_source(name: str, path) -> None:
    text = path.read_text(encoding="utf-8")
    assert re.search(r"^source: \S", text, re.MULTILINE), f"{path.name} has no top-level source"
    bare = [line for line in text.splitlines() if NUMBER_LINE.match(line) and "# source:" not in line]
    assert not bare, f"{path.name}: numbers without a '# source:' comment: {bare}"


# (model, published total, where it is published)
PUBLISHED_TOTALS = [
    ("gpt3-175b", 175e9, "Brown et al. 2020, Table 2.1"),
    ("llama3-405b", 405e9, "Llama 3 Herd of Models, Table 3"),
    ("mixtral-8x7b", 46.7e9, "Jiang et al. 2024, Mixtral of Experts, Sec. 2"),
    ("llama2-7b", 6.74e9, "meta-llama/Llama-2-7b-hf model card (6.74B)"),
    ("llama2-70b", 68.98e9, "meta-llama/Llama-2-70b-hf model card (68.98B)"),
    ("llama3-8b", 8.03e9, "meta-llama/Meta-Llama-3-8B safetensors total (8.03B)"),
    ("llama3-70b", 70.55e9, "meta-llama/Meta-Llama-3-70B safetensors total (70.55B)"),
    ("qwen3-235b-a22b", 235e9, "Qwen3 Technical Report, Table 2"),
]


@pytest.mark.parametrize(("name", "published", "where"), PUBLISHED_TOTALS, ids=[p[0] for p in PUBLISHED_TOTALS])
def test_total_parameters_match_published(name: str, published: float, where: str) -> None:
    """Issue 2: total parameters within 0.5% of the published totals (GPT-3 175B, Llama 3 405B, Mixtral 8x7B, ...)."""
    total = load_model(name).param_count()
    assert total == pytest.approx(published, rel=0.005), f"{name}: {total / 1e9:.3f}B vs {published / 1e9}B ({where})"


def test_mixtral_active_parameters() -> None:
    """Issue 2: Mixtral 8x7B active parameters within 0.5% of 12.9B."""
    # Jiang et al. 2024, Sec. 2: 47B total, 13B active; Mistral's announcement: 46.7B total, 12.9B per token.
    assert load_model("mixtral-8x7b").active_param_count() == pytest.approx(12.9e9, rel=0.005)


def test_qwen3_active_parameters() -> None:
    # Qwen publishes "22B activated", rounded to whole billions. This layout gives 22.19e9 (0.9% above 22e9),
    # of which 1.24e9 are the untied input and output embeddings; no choice of head_dim or embedding tying
    # lands within 0.5% of exactly 22e9 while keeping the 235.09e9 total right, so the check is the
    # published rounding: the count must round to 22B.
    active = load_model("qwen3-235b-a22b").active_param_count()
    assert round(active / 1e9) == 22
    assert active == pytest.approx(22e9, rel=0.01)


def test_qwen3_total_matches_checkpoint() -> None:
    # keras-hub's qwen3_moe_235b_a22b_en preset counts 235,093,634,560 parameters, the same as the Hugging Face
    # checkpoint; the spec leaves out only the per-head q_norm and k_norm scales (2 x 128 per layer x 94 layers).
    model = load_model("qwen3-235b-a22b")
    assert model.param_count() + 2 * model.head_dim * model.layers == 235_093_634_560
