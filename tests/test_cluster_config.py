"""Cluster configuration: the shipped YAML files validate, broken ones name field and line.

Pure config tests: no Ray, no model, well under a second.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from pd_runtime import config_loading as loading
from pd_runtime.config import (ClusterConfig, EngineConfig, EnginePoolSettings, KVTransferConfig,
                               ResourcesConfig, RoutingConfig)
from pd_runtime.config_loading import (ConfigError, load_cluster_config, load_routing_config,
                                       parse_cluster_config, parse_routing_config)

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "cluster_configs"
LAUNCHER = CONFIGS / "ray-cluster.yaml"
SERVE_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml") if p != LAUNCHER)


def test_the_expected_files_exist():
    names = {p.name for p in CONFIGS.glob("*.yaml")}
    assert {"local.yaml", "gpu-single-node.yaml", "gpu-multi-node.yaml",
            "ray-cluster.yaml"} <= names


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    config = load_cluster_config(path)
    assert config.decode.num_workers + config.colocated.num_workers >= 1
    # The routing section reloads on its own; it must agree with the whole-file load.
    assert load_routing_config(path) == config.router.routing


def test_gpu_examples_say_what_they_promise():
    single = load_cluster_config(CONFIGS / "gpu-single-node.yaml")
    assert (single.prefill.num_workers, single.decode.num_workers) == (2, 6)
    for pool in (single.prefill, single.decode):
        assert pool.engine.device == "cuda" and pool.resources.num_gpus == 1
        assert pool.engine.dtype == "bfloat16"
    assert single.kv_transfer.backend == "torch_dist" and single.placement.strategy == "PACK"

    multi = load_cluster_config(CONFIGS / "gpu-multi-node.yaml")
    assert multi.ray.address == "auto" and multi.kv_transfer.backend == "torch_dist"
    assert multi.placement_for("prefill").strategy == "SPREAD"
    assert multi.kv_transfer.for_node("10.0.0.7").host == "10.0.0.7"
    assert [t.tenant_id for t in multi.router.tenants] == ["search", "chat"]


def test_launcher_file_matches_rays_schema():
    jsonschema = pytest.importorskip("jsonschema")
    spec = importlib.util.find_spec("ray")  # locates the package without importing Ray
    schema_file = spec and Path(spec.submodule_search_locations[0]) / "autoscaler/ray-schema.json"
    if not schema_file or not schema_file.is_file():
        pytest.skip("Ray's launcher schema is not installed")
    launcher = yaml.safe_load(LAUNCHER.read_text())
    jsonschema.validate(launcher, json.loads(schema_file.read_text()))
    # The checks Ray's validate_config adds to the schema.
    assert launcher["head_node_type"] in launcher["available_node_types"]
    assert sum(t.get("min_workers", 0) for t in launcher["available_node_types"].values()) \
        <= launcher["max_workers"]
    # Every custom resource the multi-node pools ask for is offered by some node type.
    multi = load_cluster_config(CONFIGS / "gpu-multi-node.yaml")
    offered = {name for t in launcher["available_node_types"].values() for name in t["resources"]}
    for pool in multi.pools().values():
        assert set(pool.resources.custom) <= offered


# ---------------------------------------------------------------------------------- defaults
def test_default_config_is_local_yaml_written_out():
    assert load_cluster_config(CONFIGS / "local.yaml") == ClusterConfig()


def _assert_spelled_out(data: dict, model: type[BaseModel], where: str):
    assert set(data) == set(model.model_fields), where
    for name, field in model.model_fields.items():
        inner = loading._unwrap(field.annotation)
        keyed = typing.get_origin(field.annotation) is dict  # id -> model: no fixed keys
        if isinstance(data[name], dict) and loading._is_model(inner) and not keyed:
            _assert_spelled_out(data[name], inner, f"{where}.{name}")


def test_local_yaml_spells_out_every_field():
    data = yaml.safe_load((CONFIGS / "local.yaml").read_text())
    colocated = data.pop("colocated")  # a zero-worker pool: only its count is written
    assert colocated == {"num_workers": 0}
    fields = {k: v for k, v in ClusterConfig.model_fields.items() if k != "colocated"}
    assert set(data) == set(fields)
    for name, field in fields.items():
        if isinstance(data[name], dict):
            _assert_spelled_out(data[name], loading._unwrap(field.annotation), name)


def test_engine_config_unchanged():
    engine = EngineConfig(model="x")
    assert engine.model_dump() == {
        "model": "x", "dtype": "auto", "device": "cpu", "seed": 0, "block_size": 16,
        "max_model_len": None, "max_num_batched_tokens": 2048, "max_num_seqs": 128,
        "kv_cache_memory_bytes": 512 * 1024 * 1024, "gpu_memory_utilization": None,
        "num_kv_blocks": None,
        "enable_prefix_caching": True, "preemption_mode": "recompute",
        "swap_space_bytes": 256 * 1024 * 1024, "max_waiting_requests": 4096,
        "max_waiting_tokens": 1 << 22, "priority_aging_steps": 64, "num_threads": None,
        "tensor_parallel_size": 1, "memory_budget_bytes": None,
        "decode_kv_buffer_fraction": 1.0, "batch_invariant": True, "warmup_tokens": 1024,
        "step_time_target_s": None, "min_step_interval_s": None, "cuda_graphs": True,
        "cuda_graph_max_batch_size": 256,
        "kv_cache_dtype": "auto", "speculative_method": None, "speculative_model": None, "speculative_tokens": 4, "speculative_ngram_max": 4,
        "speculative_ngram_min": 2, "kv_offloading_size": None,
        "kv_offloading_disk_size": None, "kv_offloading_disk_dir": None}
    assert set(EngineConfig.model_fields) == set(EnginePoolSettings.model_fields) | {"model"}
    with pytest.raises(ValueError):
        EngineConfig()  # the model stays required
    with pytest.raises(ValueError):
        EngineConfig(model="x", blok_size=8)


def test_pool_engine_config_carries_the_pool_settings():
    config = load_cluster_config(CONFIGS / "gpu-single-node.yaml")
    engine = config.decode.engine_config("/m")
    assert engine == EngineConfig(model="/m", **config.decode.engine.model_dump())
    assert (engine.max_num_seqs, engine.device) == (256, "cuda")


def test_resources_to_ray():
    resources = ResourcesConfig(num_cpus=2, num_gpus=1, custom={"rdma": 1}, memory_bytes=1024)
    assert resources.ray_options() == {"num_cpus": 2, "num_gpus": 1, "resources": {"rdma": 1},
                                       "memory": 1024}
    assert resources.bundle() == {"CPU": 2, "GPU": 1, "rdma": 1, "memory": 1024}
    assert ResourcesConfig().bundle() == {"CPU": 1}


def test_kv_transfer_host_auto_is_the_node_ip():
    assert KVTransferConfig(host="auto").for_node("10.1.2.3").host == "10.1.2.3"
    assert KVTransferConfig().for_node("10.1.2.3").host == "127.0.0.1"


@pytest.mark.parametrize("address", ["", "auto", "ray://head:10001", "10.0.0.1:6379",
                                     "ray://[::1]:10001"])
def test_ray_address_forms(address):
    assert ClusterConfig.model_validate({"ray": {"address": address}}).ray.address == address


# ---------------------------------------------------------------------------------- broken files
def _error(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse_cluster_config(textwrap.dedent(text), source="broken.yaml")
    return caught.value


BROKEN = {
    "typo in a key": ("""\
        decode:
          num_workers: 1
          engine:
            blok_size: 32
        """, "decode.engine.blok_size", 4, "did you mean 'block_size'"),
    "wrong type": ("""\
        router:
          host: 0.0.0.0
          port: eighty
        """, "router.port", 3, "valid integer"),
    "bad enum": ("""\
        placement:
          strategy: CLUSTER
        """, "placement.strategy", 2, "'PACK', 'SPREAD'"),
    "negative block_size": ("""\
        prefill:
          num_workers: 1
        decode:
          num_workers: 1
          engine:
            dtype: float32
            block_size: -16
        """, "decode.engine.block_size", 7, "greater than or equal to 1"),
    "prefill without decode": ("""\
        prefill:
          num_workers: 2
        decode:
          num_workers: 0
        colocated:
          num_workers: 1
        """, "prefill.num_workers", 2, "decode.num_workers is 0"),
    "nothing decodes": ("""\
        decode:
          num_workers: 0
        """, "decode.num_workers", 2, "no worker can decode"),
    "cuda without a GPU": ("""\
        prefill:
          num_workers: 1
          engine:
            device: cuda
        """, "prefill.engine.device", 4, "num_gpus > 0"),
    "GPU without cuda": ("""\
        decode:
          num_workers: 1
          resources: {num_cpus: 2, num_gpus: 1}
        """, "decode.resources.num_gpus", 3, "set it to 'cuda'"),
    "block sizes differ": ("""\
        prefill:
          num_workers: 1
          engine:
            block_size: 32
        """, "prefill.engine.block_size", 4, "differs from decode.engine.block_size"),
    "batch invariance differs": ("""\
        prefill:
          num_workers: 1
          engine:
            batch_invariant: false
        """, "prefill.engine.batch_invariant", 4,
        "differs from decode.engine.batch_invariant"),
    "missing worker count": ("""\
        model: /m
        colocated:
          resources:
            num_cpus: 2
        """, "colocated.num_workers", 2, "Field required"),
    "duplicate api key": ("""\
        router:
          tenants:
            - tenant_id: a
              api_key: k1
            - tenant_id: b
              api_key: k1
        """, "router.tenants[1].api_key", 6, "duplicate api_key"),
    "tenant without key": ("""\
        router:
          tenants:
            - tenant_id: a
        """, "router.tenants[0].api_key", 3, "Field required"),
    "bad ray address": ("""\
        ray:
          address: http://head:8265
        """, "ray.address", 2, "ray://host:port"),
    "num_cpus with a remote Ray": ("""\
        ray:
          address: auto
          num_cpus: 4
        """, "ray.num_cpus", 3, "only a local Ray"),
    "built-in custom resource": ("""\
        decode:
          num_workers: 1
          resources:
            custom:
              GPU: 1
        """, "decode.resources.custom.GPU", 5, "built-in"),
    "autoscale bounds upside down": ("""\
        planner:
          autoscale:
            prefill: {min_workers: 3, max_workers: 1}
        """, "planner.autoscale.prefill.min_workers", 3, "above max_workers 1"),
    "autoscale bounds exclude the pool's size": ("""\
        decode: {num_workers: 1}
        planner:
          autoscale:
            enabled: true
            decode: {min_workers: 2, max_workers: 4}
        """, "decode.num_workers", 1, "outside planner.autoscale.decode [2, 4]"),
    "autoscale without a decode worker": ("""\
        planner:
          autoscale:
            decode: {min_workers: 0, max_workers: 0}
        """, "planner.autoscale.decode.max_workers", 3, "at least 1"),
    "duplicate YAML key": ("""\
        router:
          port: 8000
          port: 9000
        """, "router.port", 3, "duplicate key"),
    "always disaggregated without prefill": ("""\
        prefill: {num_workers: 0}
        router:
          routing:
            mode: always_disaggregated
        """, "router.routing.mode", 4, "prefill.num_workers"),
    "a host UCX mode for a GPU cache": ("""\
        prefill:
          num_workers: 1
          resources: {num_gpus: 1}
          engine: {device: cuda}
        decode:
          num_workers: 1
          resources: {num_gpus: 1}
          engine: {device: cuda}
        kv_transfer:
          backend: ucx
          ucx_mode: shm
        """, "kv_transfer.ucx_mode", 11, "moves host memory only"),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_broken_file_names_field_and_line(case):
    text, field, line, reason = BROKEN[case]
    error = _error(text)
    assert (error.field, error.line) == (field, line), str(error)
    assert reason in error.reason
    assert str(error).startswith(f"broken.yaml:{line}: {field}: ")


def test_error_in_a_shipped_file_points_at_its_line(tmp_path):
    lines = (CONFIGS / "local.yaml").read_text().splitlines()
    decode = lines.index("decode:")
    target = next(i for i in range(decode, len(lines)) if lines[i].strip().startswith("block_size"))
    lines[target] = "    block_size: 0"
    broken = tmp_path / "local-broken.yaml"
    broken.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as caught:
        load_cluster_config(broken)
    assert (caught.value.field, caught.value.line) == ("decode.engine.block_size", target + 1)
    assert str(caught.value).startswith(f"{broken}:{target + 1}: decode.engine.block_size: ")


def test_override_after_yaml_merge_points_at_the_override():
    error = _error("""\
        prefill:
          num_workers: 1
          engine: &engine
            block_size: 16
        decode:
          num_workers: 1
          engine:
            <<: *engine
            max_num_seqs: 0
        """)
    assert (error.field, error.line) == ("decode.engine.max_num_seqs", 9)


def test_every_issue_is_reported():
    error = _error("""\
        decode:
          num_workers: -1
        router:
          port: 70000
        """)
    assert [(i.field, i.line) for i in error.issues] == [("decode.num_workers", 2),
                                                         ("router.port", 4)]


@pytest.mark.parametrize("text, line, reason", [
    ("", 1, "empty"),
    ("# only a comment\n", 1, "empty"),
    ("- prefill\n- decode\n", 1, "mapping"),
    ("router:\n  port: [8000\n", 3, "invalid YAML"),
])
def test_unusable_files(text, line, reason):
    error = _error(text)
    assert error.field == "" and error.line == line and reason in error.reason


def test_a_pool_section_tuning_only_its_engine_keeps_its_worker(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("prefill:\n  engine: {dtype: float32}\ndecode:\n  engine: {dtype: float32}\n")
    cfg = load_cluster_config(path)
    assert (cfg.prefill.num_workers, cfg.decode.num_workers) == (1, 1)
    assert cfg.prefill.engine.dtype == cfg.decode.engine.dtype == "float32"


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_cluster_config(tmp_path / "nope.yaml")


# ---------------------------------------------------------------------------------- routing reload
def test_routing_section_alone(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("decode: {num_workers: 1}\nrouter:\n  routing:\n"
                    "    max_local_prefill_tokens: 64\n")
    assert load_routing_config(path) == RoutingConfig(max_local_prefill_tokens=64)
    assert parse_routing_config("model: /m\n") == RoutingConfig()
    # Only the routing section is checked: the router reloads it while the pools run.
    assert parse_routing_config("decode: {num_workers: 0}\n") == RoutingConfig()


def test_broken_routing_edit_names_field_and_line():
    text = "router:\n  port: 8000\n  routing:\n    mode: auto\n    decode_cost:\n" \
           "      weight_running: -1\n"
    with pytest.raises(ConfigError) as caught:
        parse_routing_config(text, source="live.yaml")
    assert (caught.value.field, caught.value.line) == ("router.routing.decode_cost.weight_running",
                                                       6)
    with pytest.raises(ConfigError) as caught:
        parse_routing_config("router:\n  routing: fast\n")
    assert (caught.value.field, caught.value.line) == ("router.routing", 2)


# ---------------------------------------------------------------------------------- docs
def _models(model: type[BaseModel], seen: dict):
    seen[model.__name__] = model
    for field in model.model_fields.values():
        inner = loading._unwrap(field.annotation)
        if loading._is_model(inner) and inner.__name__ not in seen:
            _models(inner, seen)
    return seen


def test_configuration_reference_covers_every_field():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for name, model in _models(ClusterConfig, {}).items():
        for field in model.model_fields:
            assert f"`{field}`" in doc, f"docs/configuration.md lacks {name}.{field}"


def test_a_run_store_url_of_an_unknown_kind_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("router:\n  runs:\n    store: mysql://user@host/db\n")
    with pytest.raises(ConfigError) as caught:
        load_cluster_config(path)
    assert caught.value.field == "router.runs.store" and "mysql" in str(caught.value)
    for good in ("postgresql://user@/db?host=/tmp", "sqlite:///var/runs.sqlite3", "runs.db"):
        path.write_text(f"router:\n  runs:\n    store: {good!r}\n")
        assert load_cluster_config(path).router.runs.store == good


def test_a_local_prefill_worker_borrows_the_machines_cores_by_default():
    """engine.num_threads null: on a local cluster a CPU prefill worker takes the machine's
    cores shared among its pool (at least num_cpus); decode workers, a set num_threads, a
    remote cluster, a GPU or a tensor-parallel worker keep what start_worker gives (None)."""
    from pd_runtime.workers.pool import default_threads

    cfg = ClusterConfig()
    assert default_threads(cfg, "prefill", cfg.prefill, machine_cores=2) == 2
    assert default_threads(cfg, "prefill", cfg.prefill, machine_cores=16) == 16
    assert default_threads(cfg, "decode", cfg.decode, machine_cores=16) is None
    two = ClusterConfig.model_validate({"prefill": {"num_workers": 2,
                                                    "resources": {"num_cpus": 3}}})
    assert default_threads(two, "prefill", two.prefill, machine_cores=16) == 8
    assert default_threads(two, "prefill", two.prefill, machine_cores=4) == 3  # its num_cpus
    for override in ({"prefill": {"engine": {"num_threads": 1}}}, {"ray": {"address": "auto"}},
                     {"prefill": {"engine": {"tensor_parallel_size": 2}}}):
        other = ClusterConfig.model_validate(override)
        assert default_threads(other, "prefill", other.prefill, machine_cores=16) is None


def test_a_local_decode_worker_beside_a_prefill_pool_paces_its_steps_by_default():
    """engine.min_step_interval_s null: 0.8 x the router's TPOT target for a CPU decode worker
    of a local cluster with a prefill pool; 0 without one, on a remote cluster or a GPU, and
    for prefill workers; a set value stays (None: nothing to fill in)."""
    from pd_runtime.workers.pool import default_step_interval

    cfg = ClusterConfig()
    assert default_step_interval(cfg, "decode", cfg.decode) == pytest.approx(0.08)
    assert default_step_interval(cfg, "prefill", cfg.prefill) == 0.0
    tight = ClusterConfig.model_validate({"router": {"routing": {"slo": {"tpot_s": 0.04}}}})
    assert default_step_interval(tight, "decode", tight.decode) == pytest.approx(0.032)
    for override in ({"prefill": {"num_workers": 0}}, {"ray": {"address": "auto"}},
                     {"decode": {"engine": {"device": "cuda"}, "resources": {"num_gpus": 1}}}):
        other = ClusterConfig.model_validate(override)
        assert default_step_interval(other, "decode", other.decode) == 0.0
    fixed = ClusterConfig.model_validate({"decode": {"engine": {"min_step_interval_s": 0}}})
    assert default_step_interval(fixed, "decode", fixed.decode) is None
