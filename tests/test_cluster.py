"""Cluster specs: every preset loads and round-trips; malformed specs name the YAML path and unit."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

from costmodels.cluster import (
    ClusterSpec,
    SpecError,
    cluster_to_dict,
    load_cluster,
    parse_cluster,
    preset_names,
    resize_cluster,
)
from planner.errors import InputError

PRESETS = [
    "a100-ib-384node",
    "dgx-a100",
    "dgx-h100",
    "dgx-h200",
    "h100-ib-128node",
    "h100-ib-2048node",
    "h100-ib-2node",
    "h100-pcie",
    "local-cpu",
]


def _valid() -> dict:
    """A valid two-node spec in YAML form, to break one field at a time."""
    return {
        "name": "test",
        "nodes": 2,
        "devices_per_node": 8,
        "backend": "nccl",
        "overlap_efficiency": 0.8,
        "sources": ["hand-written for tests"],
        "device": {
            "name": "gpu",
            "memory_GiB": 80,
            "peak_TFLOPS": {"bf16": 989, "fp16": 989, "fp32": 67},
            "memory_bandwidth_GBps": 3350,
            "matmul_efficiency": 0.8,
            "memory_efficiency": 0.85,
            "launch_overhead_us": 4,
        },
        "links": {
            "intra_node": {"kind": "nvlink", "bandwidth_GBps": 370, "latency_us": 5.1},
            "inter_node": {"kind": "infiniband", "bandwidth_GBps": 37.5, "latency_us": 6, "nics_per_node": 8},
        },
    }


def _set(data: dict, path: str, value: object) -> dict:
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return data


_DELETE = object()


def test_preset_names_lists_shipped_yaml() -> None:
    assert preset_names() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_cites_sources_and_round_trips(name: str) -> None:
    spec = load_cluster(name)
    assert isinstance(spec, ClusterSpec)
    assert spec.sources, "every preset cites where its numbers came from"
    assert (spec.inter_node is None) == (spec.num_nodes == 1)
    assert parse_cluster(cluster_to_dict(spec), "round trip") == spec
    # cluster_to_dict is plain YAML data
    assert parse_cluster(yaml.safe_load(yaml.safe_dump(cluster_to_dict(spec))), "yaml") == spec


def test_units_are_converted_to_si_once() -> None:
    spec = parse_cluster(_valid(), "t")
    assert spec.device.memory_bytes == 80 * 2**30
    assert spec.device.peak_flops_per_s == {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}
    assert spec.device.memory_bandwidth_bytes_per_s == 3350e9
    assert spec.device.launch_overhead_s == pytest.approx(4e-6)
    assert spec.intra_node.bandwidth_bytes_per_s == 370e9
    assert spec.intra_node.latency_s == pytest.approx(5.1e-6)
    assert spec.inter_node is not None and spec.inter_node.nics_per_node == 8
    assert spec.num_devices == 16


def test_scientific_notation_reads_as_a_number_though_yaml_1_1_reads_it_as_a_string() -> None:
    text = yaml.safe_dump(_valid()).replace("memory_bandwidth_GBps: 3350", "memory_bandwidth_GBps: 3.35e3")
    raw = yaml.safe_load(text)
    assert raw["device"]["memory_bandwidth_GBps"] == "3.35e3"  # PyYAML's resolver: a string
    assert parse_cluster(raw, "t").device.memory_bandwidth_bytes_per_s == pytest.approx(3350e9)
    raw["device"]["adam_ns_per_param"] = "4e0"
    assert parse_cluster(raw, "t").device.adam_s_per_param == pytest.approx(4e-9)
    raw["device"]["adam_ns_per_param"] = "4 ns"
    with pytest.raises(SpecError, match="adam_ns_per_param: got the string '4 ns'"):
        parse_cluster(raw, "t")
    # fractions and integers read it too (they refused '1e-1' while bandwidths took '3.35e3')
    raw["device"]["adam_ns_per_param"] = "4e0"
    raw.update(overlap_slowdown="19e-2", overlap_efficiency="8e-1", nodes="2e0")
    spec = parse_cluster(raw, "t")
    assert (spec.overlap_slowdown, spec.overlap_efficiency, spec.num_nodes) == (pytest.approx(0.19), 0.8, 2)
    raw["overlap_slowdown"] = "19%"
    with pytest.raises(SpecError, match="overlap_slowdown: got the string '19%'"):
        parse_cluster(raw, "t")


def test_a_node_count_beyond_any_cluster_is_refused() -> None:
    """nodes: 1e11 (a typo) kept the mesh search running with no end; it is refused naming the field."""
    raw = _valid()
    raw["nodes"] = 100_000_000_000
    with pytest.raises(SpecError, match=r"nodes: .* devices is beyond any cluster"):
        parse_cluster(raw, "t")
    raw["nodes"] = 1024  # a large real cluster still parses
    assert parse_cluster(raw, "t").num_nodes == 1024


def test_preset_shapes() -> None:
    assert load_cluster("dgx-h100").num_devices == 8
    assert load_cluster("h100-pcie").intra_node.kind == "pcie"
    ib = load_cluster("h100-ib-128node")
    assert (ib.num_nodes, ib.devices_per_node, ib.inter_node.nics_per_node) == (128, 8, 8)
    assert load_cluster("h100-ib-2node").inter_node.bandwidth_bytes_per_s <= 50e9  # 400 Gb/s line rate


def test_local_cpu_follows_cpu_count_and_nproc() -> None:
    assert load_cluster("local-cpu").devices_per_node == (os.cpu_count() or 1)
    spec = load_cluster("local-cpu", nproc=4)
    assert (spec.num_nodes, spec.devices_per_node, spec.backend) == (1, 4, "gloo")


def test_auto_device_count_is_for_cpu_clusters_only() -> None:
    """devices_per_node: auto counts this machine's cores: a gloo cluster's; a nccl spec saying it is
    refused naming the field (it had planned an "H100" cluster of this VM's core count)."""
    data = {**_valid(), "nodes": 1, "backend": "nccl", "devices_per_node": "auto"}
    with pytest.raises(SpecError, match=r"devices_per_node: is auto, which counts this machine's CPU cores"):
        parse_cluster(data, "spec.yaml")
    assert parse_cluster({**data, "backend": "gloo"}, "spec.yaml").devices_auto


def test_nproc_that_overrides_a_spec_s_device_count_is_said(tmp_path: Path) -> None:
    """A spec that writes devices_per_node: 1 and a --nproc 2 plan for 2 ranks, and the user is told
    (a spec saying auto follows --nproc silently: that is what auto means)."""
    from planner.cli import workflow  # noqa: PLC0415

    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump({**_valid(), "nodes": 1, "backend": "gloo", "devices_per_node": 1}))
    notes: list[str] = []
    spec = workflow.resolve_cluster(str(path), 2, notify=notes.append)
    assert spec.num_devices == 2 and len(notes) == 1, notes
    assert "--nproc 2: planning for 2 ranks, not the 1 device(s)" in notes[0] and "share" in notes[0]
    notes.clear()
    assert workflow.resolve_cluster("local-cpu", 3, notify=notes.append).num_devices == 3 and not notes


def test_nproc_shrinks_gpu_clusters_and_rejects_what_does_not_fit() -> None:
    assert load_cluster("dgx-h100", nproc=4).devices_per_node == 4
    two = load_cluster("h100-ib-128node", nproc=16)
    assert (two.num_nodes, two.devices_per_node) == (2, 8)
    one = load_cluster("h100-ib-2node", nproc=8)
    assert one.num_nodes == 1 and one.inter_node is None
    with pytest.raises(SpecError, match="nproc=16 does not fit"):
        load_cluster("dgx-h100", nproc=16)
    with pytest.raises(SpecError, match="nproc=12 does not fit"):
        load_cluster("h100-ib-2node", nproc=12)
    with pytest.raises(SpecError, match="nproc"):
        load_cluster("dgx-h100", nproc=0)


def test_load_from_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(_valid()))
    assert load_cluster(str(path)) == parse_cluster(_valid(), "x")


# ---- malformed specs: each kind names the YAML path and what is expected -------------------------

MALFORMED = [
    # (kind, path to change, new value, YAML path in message, words the message must contain)
    (
        "unknown key",
        "links.intra_node.bandwith_GBps",
        450,
        "links.intra_node.bandwith_GBps",
        ["allowed keys", "bandwidth_GBps"],
    ),
    ("missing field", "device.memory_GiB", _DELETE, "device.memory_GiB", ["missing", "GiB"]),
    (
        "missing peak dtype",
        "device.peak_TFLOPS.fp16",
        _DELETE,
        "device.peak_TFLOPS.fp16",
        ["missing", "TFLOP/s"],
    ),
    (
        "wrong type",
        "device.memory_bandwidth_GBps",
        [3350],
        "device.memory_bandwidth_GBps",
        ["expected a number in GB/s", "a list"],
    ),
    ("negative", "links.intra_node.latency_us", -1, "links.intra_node.latency_us", [">= 0", "µs"]),
    ("zero", "device.memory_GiB", 0, "device.memory_GiB", ["> 0", "GiB"]),
    (
        "bool for a number",
        "links.intra_node.bandwidth_GBps",
        True,
        "links.intra_node.bandwidth_GBps",
        ["boolean", "GB/s"],
    ),
    ("bool for an integer", "nodes", True, "nodes", ["boolean", "integer"]),
    (
        "string with unit",
        "links.intra_node.bandwidth_GBps",
        "450GB/s",
        "links.intra_node.bandwidth_GBps",
        ["'450GB/s'", "give a number in GB/s", "e.g. 450"],
    ),
    ("efficiency above 1", "device.matmul_efficiency", 1.5, "device.matmul_efficiency", ["(0, 1]", "1.5"]),
    ("efficiency zero", "device.memory_efficiency", 0, "device.memory_efficiency", ["(0, 1]"]),
    ("percentage string", "overlap_efficiency", "80%", "overlap_efficiency", ["[0, 1]", "not a percentage"]),
    ("inter_node missing", "links.inter_node", _DELETE, "links.inter_node", ["nodes is 2", "nics_per_node"]),
    ("non-integer count", "devices_per_node", 2.5, "devices_per_node", ["integer"]),
    ("bad choice", "backend", "mpi", "backend", ["nccl", "gloo"]),
    ("bad link kind", "links.inter_node.kind", "roce", "links.inter_node.kind", ["infiniband", "ethernet"]),
    ("sources not strings", "sources", [1, 2], "sources", ["list of strings"]),
    ("cache zero", "device.cache_MiB", 0, "device.cache_MiB", ["> 0", "MiB"]),
    (
        "attention efficiency above 1",
        "device.attention_efficiency",
        2,
        "device.attention_efficiency",
        ["(0, 1]"],
    ),
    (
        "stream bandwidth string",
        "device.stream_bandwidth_GBps",
        "4GB/s",
        "device.stream_bandwidth_GBps",
        ["GB/s"],
    ),
    ("section not a mapping", "device", "H100", "device", ["mapping", "memory_GiB"]),
    (
        "infinite (YAML .inf)",
        "device.memory_GiB",
        float("inf"),
        "device.memory_GiB",
        ["finite number", "GiB"],
    ),
    ("not a number (YAML .nan)", "device.memory_GiB", float("nan"), "device.memory_GiB", ["finite number"]),
]


@pytest.mark.parametrize(
    ("kind", "where", "value", "path", "words"), MALFORMED, ids=[m[0] for m in MALFORMED]
)
def test_malformed_spec_names_the_field(
    kind: str, where: str, value: object, path: str, words: list[str]
) -> None:
    data = _set(copy.deepcopy(_valid()), where, value)
    with pytest.raises(SpecError) as info:
        parse_cluster(data, "spec.yaml")
    message = str(info.value)
    assert message.startswith(f"spec.yaml: {path}: "), message
    assert info.value.path == path
    for word in words:
        assert word in message, (word, message)


def test_spec_error_is_an_input_error_with_exit_code_2() -> None:
    with pytest.raises(InputError) as info:
        parse_cluster([], "x.yaml")
    assert info.value.exit_code == 2
    assert "top level must be a mapping" in str(info.value)


def test_file_not_found_lists_presets(tmp_path: Path) -> None:
    with pytest.raises(
        SpecError, match=r"nope\.yaml: file not found \(presets are: a100-ib-384node, dgx-a100"
    ):
        load_cluster(str(tmp_path / "nope.yaml"))


def test_yaml_syntax_error_gives_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nnodes: 1\ndevice: {name: gpu, memory_GiB: 80\nlinks: {}\n")
    with pytest.raises(SpecError, match=r"YAML syntax error at line \d+, column \d+"):
        load_cluster(str(path))


def test_top_level_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- dgx-h100\n")
    with pytest.raises(SpecError, match="top level must be a mapping.*got a list"):
        load_cluster(str(path))
    path.write_text("")
    with pytest.raises(SpecError, match="got nothing"):
        load_cluster(str(path))


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(SpecError) as info:
        load_cluster("dgx-b200")
    assert "unknown cluster preset" in str(info.value)
    for name in PRESETS:
        assert name in str(info.value)


def test_yaml_is_loaded_safely(tmp_path: Path) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text("!!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(SpecError, match="YAML syntax error"):
        load_cluster(str(path))


def test_optional_cache_fields_parse_and_round_trip() -> None:
    """cache_MiB / stream_bandwidth_GBps / attention_efficiency are optional (None when absent, not written back)."""
    plain = parse_cluster(_valid(), "spec.yaml")
    assert plain.device.cache_bytes is None and plain.device.stream_bandwidth_bytes_per_s is None
    assert "cache_MiB" not in cluster_to_dict(plain)["device"]
    data = _valid()
    data["device"].update(cache_MiB=32, stream_bandwidth_GBps=4.5, attention_efficiency=0.4)
    spec = parse_cluster(data, "spec.yaml")
    assert spec.device.attention_efficiency == 0.4
    assert spec.device.cache_bytes == 32 * 2**20
    assert spec.device.stream_bandwidth_bytes_per_s == pytest.approx(4.5e9)
    assert parse_cluster(cluster_to_dict(spec), "again") == spec


def test_matmul_half_rows_round_trips_and_is_validated():
    import dataclasses

    from costmodels.cluster import SpecError, cluster_to_dict, load_cluster, parse_cluster

    local = load_cluster("local-cpu")
    spec = dataclasses.replace(local, device=dataclasses.replace(local.device, matmul_half_rows=12.5))
    data = cluster_to_dict(spec)
    assert parse_cluster(data, "x").device.matmul_half_rows == 12.5
    data["device"]["matmul_half_rows"] = -1
    with pytest.raises(SpecError, match="device.matmul_half_rows"):
        parse_cluster(data, "x")


def test_adam_fields_round_trip_and_are_validated() -> None:
    """The calibrated Adam figures: round trip, a unit slip warns, a rate without the base rate it
    refines is refused (the cost model would ignore it silently)."""
    import warnings

    from costmodels.cluster import SpecError, SpecWarning

    data = _valid()
    data["device"].update(adam_ns_per_param=3.5, adam_tensor_overhead_us=25, adam_cached_ns_per_param=2.0)
    spec = parse_cluster(data, "spec.yaml")
    assert spec.device.adam_tensor_overhead_s == pytest.approx(25e-6)
    assert spec.device.adam_cached_s_per_param == pytest.approx(2e-9)
    assert parse_cluster(cluster_to_dict(spec), "again") == spec
    data["device"]["adam_tensor_overhead_us"] = 1e9  # seconds written as microseconds?
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_cluster(data, "spec.yaml")
    assert any(
        "device.adam_tensor_overhead_us" in str(w.message)
        for w in caught
        if issubclass(w.category, SpecWarning)
    )
    del data["device"]["adam_ns_per_param"]
    with pytest.raises(
        SpecError, match="device.adam_cached_ns_per_param: is read only with device.adam_ns_per_param"
    ):
        parse_cluster(data, "spec.yaml")


def test_a_one_process_calibration_priced_for_several_ranks_is_flagged() -> None:
    """`planner calibrate --nproc 1` measures no link: a plan on 2 ranks priced with it says so."""
    import dataclasses

    from costmodels.calibrate import ROUGH_LINKS_SOURCE, unmeasured_links

    spec = parse_cluster(_valid(), "spec.yaml")
    one = dataclasses.replace(spec, sources=(*spec.sources, ROUGH_LINKS_SOURCE))
    message = unmeasured_links(one, 2)
    assert message and "calibrate --nproc 2" in message and "rough defaults" in message
    assert unmeasured_links(one, 1) is None and unmeasured_links(spec, 2) is None


def test_cpu_spec_resized_to_fewer_processes_gets_more_compute_each():
    import os

    from costmodels.cluster import load_cluster

    cores = os.cpu_count() or 1
    two = load_cluster("local-cpu", nproc=2)
    one = load_cluster("local-cpu", nproc=1)
    ratio = max(1, cores // 1) / max(1, cores // 2)
    assert one.device.peak_flops_per_s["fp32"] == pytest.approx(two.device.peak_flops_per_s["fp32"] * ratio)


def test_unit_slip_warns_naming_the_field() -> None:
    """A bandwidth given in bytes/s instead of GB/s parses but warns, naming the field and the unit."""
    import warnings

    from costmodels.cluster import SpecWarning, cluster_to_dict, load_cluster, parse_cluster

    data = cluster_to_dict(load_cluster("dgx-h100"))
    data["links"]["intra_node"]["bandwidth_GBps"] = 370_000_000_000
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = parse_cluster(data, "my.yaml")
    messages = [str(w.message) for w in caught if issubclass(w.category, SpecWarning)]
    assert len(messages) == 1, messages
    assert "my.yaml: links.intra_node.bandwidth_GBps = 370000000000 GB/s" in messages[0]
    assert "is the unit right" in messages[0]
    assert spec.intra_node.bandwidth_bytes_per_s == 370_000_000_000 * 1e9  # parsed as given, not changed
    # a CPU's page-faulting writes into fresh memory, as `planner calibrate` measured them on a loaded
    # 2-vCPU VM (0.99 GB/s): the planner's own figure, not a unit slip
    cpu = cluster_to_dict(load_cluster("local-cpu"))
    cpu["device"]["fresh_write_bandwidth_GBps"] = 0.99
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_cluster(cpu, "calibrated.yaml")
    assert not [w for w in caught if issubclass(w.category, SpecWarning)]
    for name in ("dgx-h100", "dgx-a100", "h100-pcie", "h100-ib-2node", "h100-ib-128node", "local-cpu"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_cluster(name)
        assert not [w for w in caught if issubclass(w.category, SpecWarning)], name  # presets in range


def test_more_processes_than_cores_time_share_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 ranks on 2 cores: each gets half a core, so half the compute and twice the per-node time of
    one rank per core; up to one rank per core nothing is shared."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    two, four = load_cluster("local-cpu", nproc=2), load_cluster("local-cpu", nproc=4)
    assert four.device.peak_flops_per_s["fp32"] == pytest.approx(two.device.peak_flops_per_s["fp32"] / 2)
    assert four.device.launch_overhead_s == pytest.approx(2 * two.device.launch_overhead_s)
    if two.device.node_overhead_s is not None:
        assert four.device.node_overhead_s == pytest.approx(2 * two.device.node_overhead_s)
    # gloo's loopback moves messages with the same cores: its latency stretches, its bandwidth halves
    assert four.intra_node.latency_s == pytest.approx(2 * two.intra_node.latency_s)
    assert four.intra_node.bandwidth_bytes_per_s == pytest.approx(two.intra_node.bandwidth_bytes_per_s / 2)
    # a spec in hand re-sizes the same way (what the predict-vs-measure bench does), and back (a spec
    # `planner calibrate --nproc 4` wrote time-shared, loaded for 2 ranks)
    assert resize_cluster(two, 4) == four
    back = resize_cluster(four, 2)
    assert back.device.node_overhead_s == pytest.approx(two.device.node_overhead_s)
    assert back.device.launch_overhead_s == pytest.approx(two.device.launch_overhead_s)
    assert back.device.peak_flops_per_s["fp32"] == pytest.approx(two.device.peak_flops_per_s["fp32"])
    assert back.intra_node.latency_s == pytest.approx(two.intra_node.latency_s)
    # up to one rank per core nothing is shared: the link is untouched
    assert load_cluster("local-cpu", nproc=1).intra_node == two.intra_node


def test_more_ranks_than_cores_plan_on_the_one_process_per_core_calibration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`planner optimize --nproc 4` without --cluster on 2 cores: the machine is not measured with 4
    processes (timing 4 on 2 cores measures the scheduler); the cached 2-process calibration is loaded
    and time-shared, and the plan records that file as its cluster source."""
    from costmodels.calibrate import write_cache_metadata, write_cluster_yaml
    from planner.cli import workflow

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(workflow, "CACHE_DIR", tmp_path)
    cached = tmp_path / "local-nproc2.yaml"
    write_cluster_yaml(load_cluster("local-cpu", nproc=2), cached)
    write_cache_metadata(cached, 2)

    def no_measuring(*args, **kwargs):
        raise AssertionError("calibrated again")

    monkeypatch.setattr("costmodels.calibrate.calibrate", no_measuring)
    two, four = workflow.resolve_cluster(None, 2), workflow.resolve_cluster(None, 4)
    assert (two.devices_per_node, four.devices_per_node) == (2, 4)
    assert four.device.peak_flops_per_s["fp32"] == pytest.approx(two.device.peak_flops_per_s["fp32"] / 2)
    assert four.intra_node.latency_s == pytest.approx(2 * two.intra_node.latency_s)
    assert workflow.cluster_source(None, 4) == str(cached)


def test_planners_started_together_measure_the_machine_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two plans for this machine resolved at once with no cached calibration (two `planner optimize`
    runs, or two test workers): one measures, the other waits for its spec and loads it, instead of
    both measuring on the same cores (each would see half the machine)."""
    import threading
    import time

    from planner.cli import workflow

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(workflow, "CACHE_DIR", tmp_path)
    calls = []

    def slow_calibration(nproc, **kwargs):
        calls.append(nproc)
        time.sleep(0.5)  # long enough for the other thread to look at the cache meanwhile
        return load_cluster("local-cpu", nproc=nproc)

    monkeypatch.setattr("costmodels.calibrate.calibrate", slow_calibration)
    specs = []
    threads = [
        threading.Thread(target=lambda: specs.append(workflow.resolve_cluster(None, 2))) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [2] and len(specs) == 2 and specs[0] == specs[1], calls


def test_a_plan_on_fewer_ranks_than_a_time_shared_spec_is_priced_unshared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--nproc 3 on 2 cores: a plan that runs 1 or 2 ranks takes a core each (the idle third process
    takes no share), so it is priced on the 2-process spec; one that runs all 3 is time-shared."""
    from costmodels.cluster import cluster_for_ranks

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    two, three = load_cluster("local-cpu", nproc=2), load_cluster("local-cpu", nproc=3)
    assert three.device.node_overhead_s == pytest.approx(1.5 * two.device.node_overhead_s)
    for ranks in (1, 2):
        priced = cluster_for_ranks(three, ranks)
        assert priced.device.node_overhead_s == pytest.approx(two.device.node_overhead_s)
        assert priced.device.peak_flops_per_s["fp32"] == pytest.approx(two.device.peak_flops_per_s["fp32"])
        assert priced.intra_node.latency_s == pytest.approx(two.intra_node.latency_s)
    assert cluster_for_ranks(three, 3) is three
    assert cluster_for_ranks(two, 1) is two  # one process per core: nothing to undo
    assert cluster_for_ranks(load_cluster("dgx-h100"), 1).name == "dgx-h100"


def test_a_key_given_twice_is_refused_and_memory_typed_in_mib_warns(tmp_path: Path) -> None:
    """Plain YAML keeps the last of two equal keys silently (a spec with launch_overhead_us twice planned
    with the second): a spec or plan repeating a key is refused naming both lines; a device memory far
    beyond any device's (MiB typed as GiB) warns."""
    from planner.plan import Plan

    text = (Path(__file__).resolve().parent.parent / "costmodels" / "clusters" / "dgx-a100.yaml").read_text()
    dup = tmp_path / "dup.yaml"
    dup.write_text(
        text.replace("  launch_overhead_us: 4\n", "  launch_overhead_us: 4\n  launch_overhead_us: 40\n")
    )
    with pytest.raises(InputError, match=r"'launch_overhead_us' appears twice \(lines \d+ and \d+\)"):
        load_cluster(str(dup))
    mib = tmp_path / "mib.yaml"
    mib.write_text(text.replace("  memory_GiB: 80\n", "  memory_GiB: 79600\n"))
    with pytest.warns(UserWarning, match="memory_GiB = 79600"):
        load_cluster(str(mib))
    plan = tmp_path / "plan.yaml"
    plan.write_text("workload: forward\nworkload: train\n")
    with pytest.raises(InputError, match="'workload' appears twice"):
        Plan.from_yaml(plan)


@pytest.mark.parametrize("base", ["SafeLoader", "CSafeLoader"])
def test_repeated_keys_are_refused_by_the_python_and_the_libyaml_parser(base: str) -> None:
    """`UniqueKeyLoader` parses with libyaml where PyYAML has it and with PyYAML's own parser
    otherwise: the same documents, the same refusal of a repeated key with both lines."""
    import yaml

    from costmodels import cluster as cluster_module

    if not hasattr(yaml, base):
        pytest.skip(f"PyYAML without {base}")
    loader = type("Loader", (cluster_module._UniqueKeys, getattr(yaml, base)), {})
    text = "a: 1\nb: {c: [1, 2.5, x]}\n"
    assert yaml.load(text, Loader=loader) == {"a": 1, "b": {"c": [1, 2.5, "x"]}}  # noqa: S506
    with pytest.raises(yaml.YAMLError, match=r"'a' appears twice \(lines 1 and 3\)"):
        yaml.load("a: 1\nb: 2\na: 3\n", Loader=loader)  # noqa: S506
    data = {"reason": "a long line " * 20, "n": [1, 2], "x": 0.5}
    assert yaml.load(cluster_module.safe_dump(data, width=110), Loader=loader) == data  # noqa: S506
    # a YAML merge key (`<<: *anchor`) is plain YAML, not a repeated key: it was refused as "could not
    # determine a constructor for the tag"; the explicit keys beside it win, as YAML says
    merged = yaml.load("a: &x {p: 1, q: 2}\nb:\n  <<: *x\n  q: 3\n", Loader=loader)  # noqa: S506
    assert merged == {"a": {"p": 1, "q": 2}, "b": {"p": 1, "q": 3}}


def test_nvls_is_a_validated_intra_node_flag_that_round_trips() -> None:
    """`links.intra_node.nvls`: NVLink SHARP in the node's NVSwitches (H100 / H200 presets), a boolean,
    NVLink only, absent = false; not allowed on the inter-node link."""
    import dataclasses

    h100 = load_cluster("dgx-h100")
    h100 = dataclasses.replace(h100, intra_node=dataclasses.replace(h100.intra_node, nvls=True))
    assert not load_cluster("dgx-a100").intra_node.nvls
    data = cluster_to_dict(h100)
    assert data["links"]["intra_node"]["nvls"] is True
    assert parse_cluster(data, "x") == h100
    for bad, match in (("yes", "true or false"), (1, "true or false")):
        broken = copy.deepcopy(data)
        broken["links"]["intra_node"]["nvls"] = bad
        with pytest.raises(SpecError, match=rf"links\.intra_node\.nvls.*{match}"):
            parse_cluster(broken, "x")
    pcie = copy.deepcopy(data)
    pcie["links"]["intra_node"]["kind"] = "pcie"
    with pytest.raises(SpecError, match="needs kind: nvlink"):
        parse_cluster(pcie, "x")
    two = cluster_to_dict(load_cluster("h100-ib-2node"))
    two["links"]["inter_node"]["nvls"] = True
    with pytest.raises(SpecError, match="unknown key 'nvls'"):
        parse_cluster(two, "x")


def test_pins_beyond_a_preset_resized_by_nproc_name_the_resize() -> None:
    """`--cluster dgx-h100 --nproc 2 --tp 4` said "dgx-h100 has 2", which reads as a wrong preset."""
    from planner.cli.workflow import check_constraints_fit  # noqa: PLC0415
    from planner.solver.problem import Constraints  # noqa: PLC0415

    resized = load_cluster("dgx-h100", nproc=2)
    assert resized.resized_from == 8 and load_cluster("dgx-h100").resized_from is None
    assert resized == load_cluster("dgx-h100", nproc=2)  # not part of what the cluster is
    with pytest.raises(InputError, match=r"tp\(4\) = 4 devices, but dgx-h100 has 2 \(--nproc 2 of its 8\)"):
        check_constraints_fit(resized, Constraints(tp=4), 8, None)
    with pytest.raises(InputError, match=r"dgx-h100 has 8$"):
        check_constraints_fit(load_cluster("dgx-h100"), Constraints(tp=16), 16, None)
