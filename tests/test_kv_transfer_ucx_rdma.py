"""The UCX rdma mode on a machine without an RDMA NIC: its settings against the table in
docs/kv_transfer.md, the user's own variables winning, the refusals at agent start (for real:
none of these machines has one, and the pip UCX has no InfiniBand module), the transport it
builds where the devices are pretended, and the config field."""

import os
import re
import textwrap
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from pd_runtime.config import KVTransferConfig
from pd_runtime.config_loading import ConfigError, parse_cluster_config
from pd_runtime.kv_transfer.backends import ucx as ucx_module, ucx_worker
from pd_runtime.kv_transfer.base import KVTransferError
from pd_runtime.kv_transfer.registry import create_agent, make_transport
from pd_runtime.kv_transfer.backends.ucx_worker import (check_rdma_transports, context_config,
                                               mode_environment, prepare_environment,
                                               require_rdma_devices, resolve_mode)
from tests.kv_transfer_support.common import config

pytestmark = pytest.mark.timeout(60)
DOCS = Path(__file__).resolve().parent.parent / "docs" / "kv_transfer.md"
CUDA0 = torch.device("cuda", 0)
CACHES = {"host": None, "CUDA": CUDA0}


@pytest.fixture
def ucx_env(monkeypatch):
    """Every variable a mode may set, unset for the test and restored after it (monkeypatch
    records a variable's absence only once it has set it)."""
    names = {name for mode in ("tcp", "shm", "cuda", "rdma") for device in CACHES.values()
             for name in mode_environment(mode, device)}
    for name in sorted(names):
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    return monkeypatch


def _settings(cell: str) -> dict:
    return dict(re.findall(r"`([A-Z_]+)=([^`]*)`", cell))


def _documented_rows() -> list:
    """(mode, cache, environment, context settings) of the table "UCX settings per mode"."""
    text = DOCS.read_text()
    blocks = text[text.index("### UCX settings per mode"):].split("\n\n")
    table = next(block for block in blocks if block.startswith("|"))
    rows = [line.strip("|").split("|") for line in table.splitlines()[2:]]
    return [(mode.strip(" `"), cache.strip(), _settings(env), _settings(ctx))
            for mode, cache, env, ctx in rows]


# ----- the settings are the documented ones
def test_the_table_covers_every_mode():
    assert [(mode, cache) for mode, cache, _, _ in _documented_rows()] == [
        ("tcp", "host"), ("shm", "host"), ("cuda", "CUDA"), ("rdma", "host"), ("rdma", "CUDA")]


@pytest.mark.parametrize("row", _documented_rows(), ids=lambda row: f"{row[0]}-{row[1]}")
def test_each_mode_sets_what_the_docs_say(row):
    mode, cache, environment, context = row
    assert mode_environment(mode, CACHES[cache]) == environment
    assert context_config(mode) == context


def test_rdma_settings_in_full():
    assert mode_environment("rdma") == {"UCX_TLS": "rc,dc,sm,self"}
    assert mode_environment("rdma", torch.device("cpu")) == {"UCX_TLS": "rc,dc,sm,self"}
    assert mode_environment("rdma", CUDA0) == mode_environment("rdma", torch.device("cuda")) == {
        "UCX_TLS": "rc,dc,sm,self,cuda", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
    # no tcp to fall back on, and TLS left to the environment (the user's UCX_TLS wins)
    assert "tcp" not in mode_environment("rdma", CUDA0)["UCX_TLS"].split(",")
    assert context_config("rdma") == {"RNDV_SCHEME": "get_zcopy"}


def test_ucx_takes_the_rdma_settings_and_reads_tls_from_the_environment(ucx_env):
    ucx_api, _ = ucx_worker.ucx_modules()
    prepare_environment("rdma")
    effective = ucx_api.UCXContext(config_dict=context_config("rdma")).config
    assert effective["TLS"] == "rc,dc,sm,self" and effective["RNDV_SCHEME"] == "get_zcopy"
    assert effective["NET_DEVICES"] == "all"  # left to UCX


# ----- the user's own variables win
def test_prepare_environment_keeps_what_the_user_set(ucx_env):
    ucx_env.setenv("UCX_TLS", "rc_x,sm,self,cuda")
    prepare_environment("rdma", CUDA0)
    assert os.environ["UCX_TLS"] == "rc_x,sm,self,cuda"
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"  # the one the user left unset
    ucx_env.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n")
    prepare_environment("rdma", CUDA0)
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "n"


def test_prepare_environment_into_a_given_mapping_leaves_the_process_alone(ucx_env):
    environ = {"UCX_TLS": "rc,self"}
    prepare_environment("rdma", CUDA0, environ)
    assert environ == {"UCX_TLS": "rc,self", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
    assert "UCX_TLS" not in os.environ and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ
    for mode in ("tcp", "shm"):
        prepare_environment(mode, None, environ)
    assert environ == {"UCX_TLS": "rc,self", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


# ----- which mode an agent gets
@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3"])
@pytest.mark.parametrize("device", [None, torch.device("cpu"), CUDA0])
def test_rdma_is_kept_for_any_cache_and_host_and_auto_never_picks_it(host, device):
    assert resolve_mode("rdma", host, device) == "rdma"
    assert resolve_mode("auto", host, device) != "rdma"


def test_a_host_mode_for_a_cuda_cache_points_at_rdma_too():
    with pytest.raises(KVTransferError, match=r"kv_transfer.ucx_mode 'tcp'.*'auto'.*'rdma'"):
        resolve_mode("tcp", "10.1.2.3", CUDA0)


# ----- no RDMA device: the agent does not start
def test_devices_are_read_from_sysfs(tmp_path):
    for missing in (tmp_path / "absent", tmp_path):
        with pytest.raises(KVTransferError, match=rf"kv_transfer.ucx_mode 'rdma' needs an RDMA NIC "
                                                  rf".*{re.escape(str(missing))} is absent or empty"):
            require_rdma_devices(str(missing))
    for name in ("mlx5_1", "mlx5_0"):
        (tmp_path / name).mkdir()
    assert require_rdma_devices(str(tmp_path)) == ["mlx5_0", "mlx5_1"]


def _without_rdma_devices():
    try:
        devices = require_rdma_devices()
    except KVTransferError:
        return
    pytest.skip(f"this machine has RDMA devices ({', '.join(devices)})")


@pytest.mark.parametrize("device", [torch.device("cpu"), CUDA0])
def test_no_rdma_device_fails_the_agent_at_start(device, ucx_env):
    _without_rdma_devices()
    caches = [torch.zeros(4, 64, dtype=torch.uint8)]
    if device.type == "cpu":
        with pytest.raises(KVTransferError, match=r"kv_transfer.ucx_mode 'rdma' needs an RDMA NIC "
                                                  r"\(InfiniBand or RoCE\).*/sys/class/infiniband"):
            create_agent(config("ucx", ucx_mode="rdma"), caches, engine_id="e", model_id="m")
    with pytest.raises(KVTransferError, match="kv_transfer.ucx_mode 'rdma' needs an RDMA NIC"):
        make_transport(config("ucx", ucx_mode="rdma"), device)  # before any CUDA or UCX call
    # refused before the mode's variables were set
    assert "UCX_TLS" not in os.environ and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ


def test_devices_ucx_cannot_use_fail_the_agent_at_start(ucx_env):
    """A real UCX context, devices pretended: the pip UCX has no InfiniBand module, and says so."""
    ucx_env.setattr(ucx_module, "require_rdma_devices", lambda: ["mlx5_0"])
    with pytest.raises(KVTransferError) as caught:
        make_transport(config("ucx", ucx_mode="rdma"), torch.device("cpu"))
    message = str(caught.value)
    assert message.startswith("kv_transfer.ucx_mode 'rdma': UCX found no rc or dc transport "
                              "(rc_mlx5, rc_verbs, dc_mlx5) on this machine's RDMA devices (mlx5_0)")
    assert "usable: " in message and "self" in message
    if not ucx_worker._ucx_module_dir() or not list(Path(ucx_worker._ucx_module_dir()).glob("libuct_ib.so*")):
        assert "no InfiniBand module (libuct_ib.so)" in message
        assert "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true" in message


class _Context:
    """A UCX context as check_rdma_transports reads it."""

    def __init__(self, *transports, tls="rc,dc,sm,self"):
        self.info = "\n".join(f"#      resource {i}  :  md {i}  dev {i}  flags -- {name}"
                              for i, name in enumerate(transports))
        self.config = {"TLS": tls, "NET_DEVICES": "mlx5_3:1"}


def test_rc_or_dc_is_what_counts(tmp_path, monkeypatch):
    for found in (("rc_mlx5/mlx5_0:1", "ud_mlx5/mlx5_0:1"), ("rc_verbs/rxe0:1",),
                  ("dc_mlx5/mlx5_0:1", "self/memory")):
        check_rdma_transports(_Context(*found), ["mlx5_0"])
    # a UCX with its InfiniBand module: the message points at ports and the user's variables
    (tmp_path / "libuct_ib.so.0").touch()
    monkeypatch.setattr(ucx_worker, "_ucx_module_dir", lambda: str(tmp_path))
    with pytest.raises(KVTransferError, match=r"devices \(mlx5_0, mlx5_1\); usable: self, tcp, ud_mlx5\. "
                                              r"Check that a port is active.*UCX_TLS \(ud,tcp,self\)"
                                              r".*UCX_NET_DEVICES \(mlx5_3:1\)"):
        check_rdma_transports(_Context("ud_mlx5/mlx5_0:1", "tcp/eth0", "self/memory", tls="ud,tcp,self"),
                              ["mlx5_0", "mlx5_1"])


# ----- where devices and transports are pretended: the transport the mode builds
@pytest.mark.parametrize("device", [torch.device("cpu"), CUDA0])
def test_an_rdma_transport_is_caller_driven_with_error_handling(device, ucx_env):
    ucx_env.setattr(ucx_module, "require_rdma_devices", lambda: ["mlx5_0"])
    ucx_env.setattr(ucx_module, "check_rdma_transports", lambda context, devices: None)
    ucx_env.setattr(ucx_module, "check_cuda_transports", lambda context, device: None)
    transport = make_transport(config("ucx", ucx_mode="rdma"), device)  # touches no CUDA
    try:
        assert transport.mode == "rdma" and transport.address()["mode"] == "rdma"
        assert transport._context.config["TLS"] == mode_environment("rdma", device)["UCX_TLS"]
        assert transport._context.config["RNDV_SCHEME"] == "get_zcopy"
        assert transport._ucx_worker.caller_progress and transport._error_handling
        assert transport._drain_s == ucx_module._RDMA_DRAIN_S
        assert transport._ucx_worker.device == (CUDA0 if device.type == "cuda" else None)
    finally:
        transport.close()
    assert os.environ["UCX_TLS"] == mode_environment("rdma", device)["UCX_TLS"]


# ----- the config field
def test_the_field_takes_rdma_with_the_ucx_backend_only():
    assert KVTransferConfig(backend="ucx", ucx_mode="rdma").ucx_mode == "rdma"
    with pytest.raises(ValidationError, match=r"ucx_mode: 'rdma' applies to backend 'ucx' only, "
                                              r"and kv_transfer.backend is 'torch_dist'"):
        KVTransferConfig(backend="torch_dist", ucx_mode="rdma")
    with pytest.raises(ValidationError, match="ucx_mode"):
        KVTransferConfig(backend="ucx", ucx_mode="verbs")


_GPU_POOLS = """\
    prefill:
      num_workers: 1
      resources: {num_gpus: 1}
      engine: {device: cuda}
    decode:
      num_workers: 1
      resources: {num_gpus: 1}
      engine: {device: cuda}
    """


def _cluster(kv_transfer: str):
    return parse_cluster_config(textwrap.dedent(_GPU_POOLS) + textwrap.dedent(kv_transfer),
                                source="rdma.yaml")


def test_a_cluster_file_takes_rdma_for_gpu_caches():
    cfg = _cluster("""\
        kv_transfer:
          backend: ucx
          ucx_mode: rdma
        """)
    assert cfg.kv_transfer.ucx_mode == "rdma"


@pytest.mark.parametrize("kv_transfer, line, reason", [
    ("kv_transfer:\n  backend: torch_dist\n  ucx_mode: rdma\n", 11, "applies to backend 'ucx' only"),
    ("kv_transfer:\n  backend: ucx\n  ucx_mode: verbs\n", 11, "'auto', 'tcp', 'shm' or 'rdma'"),
    ("kv_transfer:\n  backend: ucx\n  ucx_mode: tcp\n", 11, "moves host memory only"),
], ids=["another backend", "unknown mode", "host mode for a GPU cache"])
def test_a_cluster_file_names_the_field_and_line(kv_transfer, line, reason):
    with pytest.raises(ConfigError) as caught:
        _cluster(kv_transfer)
    error = caught.value
    assert (error.field, error.line) == ("kv_transfer.ucx_mode", line), str(error)
    assert reason in error.reason
