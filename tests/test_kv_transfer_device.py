"""KV transfer with caches on CUDA, the parts a CPU box can check: the same-GPU config rule, the
UCX mode and settings a CUDA cache gets, that host buffers keep the host path, device messages
as ucxx sees them, the per-thread CUDA binding and the sync before a device send (against a
recording stand-in for torch.cuda), and bench/gpu_transfer.py's plumbing on host memory."""

import os
import random
import threading

import numpy
import pytest
import torch

from bench.gpu_transfer import Shape, run
from pd_runtime.kv_transfer.backends import ucx as ucx_module, ucx_worker
from pd_runtime.kv_transfer.base import KVTransferError, LinkError, LinkState, SendOutcome, TransferState
from pd_runtime.kv_transfer.registry import create_agent, make_transport
from pd_runtime.kv_transfer.backends.ucx import UCXTransport
from pd_runtime.kv_transfer.backends.ucx_worker import (DIRECT_MIN_BYTES, DeviceBytes, Worker, as_bytes,
                                    check_cuda_transports, context_config, context_transports,
                                    device_array, flat, prepare_environment, resolve_mode,
                                    ucx_modules)
from tests.kv_transfer_support.common import (collect, config, fill_random, make_caches,
                                              poison_untouched, wait_for)

pytestmark = pytest.mark.timeout(90)
CUDA0 = torch.device("cuda", 0)


# ----- workers sharing a GPU: no backend is refused (torch_dist moves that KV by IPC)
@pytest.mark.parametrize("backend", ["torch_dist", "ucx"])
def test_pools_on_fractional_gpus_validate_with_either_backend(backend):
    from pd_runtime.config import ClusterConfig

    engine = {"device": "cuda"}
    cfg = ClusterConfig.model_validate({
        "kv_transfer": {"backend": backend},
        "prefill": {"num_workers": 1, "resources": {"num_gpus": 0.5}, "engine": engine},
        "decode": {"num_workers": 1, "resources": {"num_gpus": 0.5}, "engine": engine}})
    assert cfg.kv_transfer.backend == backend


# ----- the UCX mode and settings
@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "localhost"])
def test_a_cuda_cache_gets_the_cuda_mode_whatever_the_host(host):
    assert resolve_mode("auto", host, torch.device("cuda")) == "cuda"
    assert resolve_mode("auto", host, CUDA0) == "cuda"


@pytest.mark.parametrize("mode", ["tcp", "shm"])
def test_a_host_mode_is_refused_for_a_cuda_cache(mode):
    with pytest.raises(KVTransferError, match=f"kv_transfer.ucx_mode '{mode}'.*'auto'"):
        resolve_mode(mode, "127.0.0.1", CUDA0)


def test_host_caches_resolve_as_before():
    for device in (None, torch.device("cpu")):
        assert resolve_mode("auto", "127.0.0.1", device) == "shm"
        assert resolve_mode("auto", "10.1.2.3", device) == "tcp"
        assert resolve_mode("tcp", "127.0.0.1", device) == "tcp"
        assert resolve_mode("shm", "10.1.2.3", device) == "shm"


def test_cuda_context_settings_and_ucx_takes_them():
    cfg = context_config("cuda")
    assert set(cfg["TLS"].split(",")) == {"cuda_ipc", "cuda_copy", "sm", "tcp", "self"}
    assert cfg["RNDV_SCHEME"] == "get_zcopy" and cfg["RNDV_THRESH"] == str(DIRECT_MIN_BYTES)
    # host modes keep their exact settings, without CUDA transports
    assert context_config("tcp") == {"TLS": "tcp,self"}
    assert context_config("shm") == {"TLS": "sm,self", "RNDV_SCHEME": "get_zcopy",
                                     "RNDV_THRESH": str(DIRECT_MIN_BYTES)}
    # UCX parses them (an unknown name would raise); the CUDA transports are missing here, a warning
    ucx_api, _ = ucx_modules()
    effective = ucx_api.UCXContext(config_dict=cfg).config
    assert effective["TLS"] == cfg["TLS"] and effective["RNDV_SCHEME"] == "get_zcopy"
    assert effective["RNDV_THRESH"] == "intra:4K,inter:4K"


def test_cuda_mode_turns_on_get_over_cuda_ipc_unless_the_user_set_it(monkeypatch):
    # (set, then deleted: monkeypatch restores the variable's absence, or its value, after)
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "x")
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
    for mode in ("tcp", "shm"):
        prepare_environment(mode)
        assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ
    prepare_environment("cuda")
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "auto")
    prepare_environment("cuda")
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "auto"


class _Context:
    """A UCX context as check_cuda_transports reads it: its resource list."""

    def __init__(self, *transports):
        self.info = "\n".join(f"#      resource {i}  :  md {i}  dev {i}  flags -- {name}"
                               for i, name in enumerate(transports))


def test_a_context_without_usable_cuda_copy_is_refused(caplog):
    with pytest.raises(KVTransferError, match="no CUDA transport.*cuda:0.*'torch_dist'"):
        check_cuda_transports(_Context("self/memory", "tcp/lo", "posix/memory"), CUDA0)
    check_cuda_transports(_Context("cuda_copy/cuda", "tcp/lo"), CUDA0)  # staged: a warning
    assert "no cuda_ipc" in caplog.text
    caplog.clear()
    check_cuda_transports(_Context("cuda_copy/cuda", "cuda_ipc/cuda", "sm/memory"), CUDA0)
    assert not caplog.text
    # a real context lists what this machine has (without a CUDA driver: no cuda_* at all)
    ucx_api, _ = ucx_modules()
    found = context_transports(ucx_api.UCXContext(config_dict=context_config("cuda")))
    assert {"self", "tcp"} <= found


def test_the_registry_gives_a_cuda_cache_a_cuda_mode_transport(monkeypatch):
    checked = []
    monkeypatch.setattr(ucx_module, "check_cuda_transports", lambda context, device: checked.append(device))
    transport = make_transport(config("ucx"), CUDA0)  # nothing here touches CUDA until it progresses
    try:
        assert checked == [CUDA0]
        assert transport.mode == "cuda" and transport.address()["mode"] == "cuda"
        assert transport._ucx_worker.device == CUDA0 and transport._ucx_worker.caller_progress
        assert not transport._error_handling
    finally:
        transport.close()


def test_a_host_cache_keeps_its_host_mode_transport():
    host = make_transport(config("ucx"), torch.device("cpu"))
    try:
        assert host.mode == "shm" and host._ucx_worker.device is None
        assert host._ucx_worker.progress.__func__ is Worker.progress  # no binding step on the host path
    finally:
        host.close()


# ----- buffers
def test_host_buffers_keep_the_host_path_on_a_device_capable_link():
    tensor = torch.arange(64, dtype=torch.float32)
    array = numpy.arange(16, dtype=numpy.uint8)
    views = flat([tensor, array], device_ok=True)
    assert all(type(v) is numpy.ndarray and v.dtype == numpy.uint8 for v in views)
    assert numpy.shares_memory(views[0], tensor.numpy()) and views[1] is not array
    assert views[0].nbytes == 256 and numpy.shares_memory(views[1], array)


def test_a_device_tensor_is_refused_where_the_context_moves_host_memory():
    meta = torch.empty(4096, dtype=torch.uint8, device="meta")
    with pytest.raises(KVTransferError, match="host memory only"):
        as_bytes(meta)
    with pytest.raises(KVTransferError, match="host memory only"):
        flat([numpy.zeros(4, numpy.uint8), meta])
    assert type(as_bytes(meta, device_ok=True)) is DeviceBytes


def test_device_bytes_as_ucxx_reads_them():
    base = torch.arange(4096, dtype=torch.bfloat16)
    region = base[1024:3072]  # a contiguous region inside a larger allocation
    message = DeviceBytes(region)
    array = device_array(message)
    assert array.cuda and array.nbytes == 4096 and array.ptr == region.data_ptr()
    assert array.contiguous and array.obj is message and message.tensor is region
    with pytest.raises(KVTransferError, match="contiguous"):
        DeviceBytes(base.view(64, 64)[:, :8])


# ----- the CUDA binding and the sync before a send, against a stand-in for torch.cuda
class _RecordingCuda:
    def __init__(self):
        self.calls = []

    def set_device(self, device):
        self.calls.append(("set_device", threading.get_ident(), device))

    def synchronize(self, device=None):
        self.calls.append(("synchronize", threading.get_ident(), device))


def test_each_thread_binds_the_device_once_and_device_sends_wait_for_their_writes(monkeypatch):
    cuda = _RecordingCuda()
    monkeypatch.setattr(torch, "cuda", cuda)
    monkeypatch.setattr(ucx_worker._thread_state, "cuda_device", None, raising=False)
    ucx_api, _ = ucx_modules()
    worker = Worker(ucx_api.UCXContext(config_dict=context_config("shm")), caller_progress=True, device=CUDA0)
    worker.progress()
    worker.progress()
    me = threading.get_ident()
    assert cuda.calls == [("set_device", me, CUDA0), ("synchronize", me, None)]
    other = threading.Thread(target=worker.progress)
    other.start()
    other.join()
    assert [c[0] for c in cuda.calls[2:]] == ["set_device", "synchronize"] and cuda.calls[2][1] != me
    cuda.calls.clear()
    worker.sources_ready([numpy.zeros(1024, numpy.uint8)])  # host frames only: nothing to wait for
    assert cuda.calls == []
    worker.sources_ready([numpy.zeros(1024, numpy.uint8),
                          DeviceBytes(torch.empty(4096, dtype=torch.uint8, device="meta"))])
    assert cuda.calls == [("synchronize", me, CUDA0)]
    cuda.calls.clear()
    worker.retire("test")  # a device copy UCX started is waited for
    assert cuda.calls == [("synchronize", me, CUDA0)]
    with pytest.raises(LinkError, match="retired"):
        worker.progress()


# ----- whole transfers on host memory
def test_a_cuda_mode_context_carries_kv_bit_exact():
    """The cuda mode's context (CUDA transports listed, caller-driven progress, no endpoint
    error handling, receiver-pull rendezvous) on host caches: control frames and KV pass."""
    src_big, src_caches = make_caches()
    dst_big, dst_caches = make_caches()
    cfg = config("ucx")
    sender = create_agent(cfg, src_caches, engine_id="P", model_id="m",
                          transport=UCXTransport("127.0.0.1", 0, "cuda"))
    receiver = create_agent(cfg, dst_caches, engine_id="D", model_id="m",
                            transport=UCXTransport("127.0.0.1", 0, "cuda"))
    try:
        _transfer_and_check(sender, receiver, src_big, src_caches, dst_big, seed=5)
    finally:
        sender.close()
        receiver.close()


def _transfer_and_check(sender, receiver, src_big, src_caches, dst_big, seed):
    """Three requests: a lone block (small messages), scattered blocks, a run; bit-exact, and
    nothing written outside the reserved blocks."""
    rng = random.Random(seed)
    peer = sender.connect(receiver.metadata())
    wait_for(lambda: sender.peer_state(peer)[0] is LinkState.READY, 15)
    plans, free_src, free_dst = {}, rng.sample(range(40), 40), rng.sample(range(40), 40)
    for index, n in enumerate([1, 4, 7]):
        src_ids, free_src = free_src[:n], free_src[n:]
        dst_ids, free_dst = free_dst[:n], free_dst[n:]
        if index == 2:
            src_ids, dst_ids = list(range(40, 47)), list(range(40, 47))
        fill_random(src_caches, src_ids, seed=index)
        rid = f"r{index}"
        receiver.expect(rid, dst_ids)
        plans[rid] = (src_ids, dst_ids)
        wait_for(lambda: sender.send(peer, rid, src_ids, dst_ids) is SendOutcome.ACCEPTED)
    assert {s.state for s in collect(sender, plans, 15).values()} == {TransferState.DONE}
    assert {s.state for s in collect(receiver, plans, 15).values()} == {TransferState.DONE}
    for src_ids, dst_ids in plans.values():
        assert torch.equal(dst_big[:, :, dst_ids], src_big[:, :, src_ids])
    assert poison_untouched(dst_big, [b for _, d in plans.values() for b in d])


def test_the_device_branch_end_to_end_with_host_memory_standing_in(monkeypatch):
    """Agents whose transports believe their caches are on cuda:0, every message going as
    DeviceBytes (frames and KV, small ones too) over host memory: UCX finds the memory type by
    pointer, so it moves host bytes, and the device branch's own code runs whole: binding,
    the sync before a device send, device arrays, in-place receives of every size."""
    cuda = _RecordingCuda()
    monkeypatch.setattr(torch, "cuda", cuda)
    monkeypatch.setattr(ucx_worker._thread_state, "cuda_device", None, raising=False)
    monkeypatch.setattr(ucx_module, "check_cuda_transports", lambda context, device: None)
    host_as_bytes = ucx_worker.as_bytes

    def as_device_bytes(buf, device_ok=False):
        if not device_ok:
            return host_as_bytes(buf)
        tensor = torch.from_numpy(buf) if isinstance(buf, numpy.ndarray) else buf
        return DeviceBytes(tensor.reshape(-1).view(torch.uint8))

    monkeypatch.setattr(ucx_worker, "as_bytes", as_device_bytes)
    src_big, src_caches = make_caches()
    dst_big, dst_caches = make_caches()
    cfg = config("ucx")
    sender = create_agent(cfg, src_caches, engine_id="P", model_id="m",
                          transport=UCXTransport("127.0.0.1", 0, "auto", CUDA0))
    receiver = create_agent(cfg, dst_caches, engine_id="D", model_id="m",
                            transport=UCXTransport("127.0.0.1", 0, "auto", CUDA0))
    try:
        _transfer_and_check(sender, receiver, src_big, src_caches, dst_big, seed=3)
    finally:
        sender.close()
        receiver.close()
    # the agents' threads that drove UCX (readers, writers, the sending thread) bound cuda:0
    assert len({ident for name, ident, device in cuda.calls if name == "set_device" and device == CUDA0}) >= 3
    assert any(name == "synchronize" and device == CUDA0 for name, _, device in cuda.calls)


@pytest.mark.parametrize("backend,mode", [("ucx", "shm"), ("torch_dist", "gloo")])
def test_gpu_bench_plumbing_on_host_memory(backend, mode):
    shape = Shape(layers=2, kv_heads=2, head_dim=64, dtype="bf16", block=16)
    result = run("cpu", backend, [32, 64], iters=1, shape=shape)
    assert "error" not in result, result.get("error")
    assert result["mode"] == mode and result["device"] == "cpu"
    rows = result["transfer"]
    assert [r["tokens"] for r in rows] == [32, 64]
    for row in rows:
        assert row["bytes"] == row["tokens"] * 2 * 2 * 2 * 64 * 2
        assert row["gbs"] > 0 and row["copy_gbs"] > 0 and row["raw_gbs"] > 0
        assert row["ratio"] == pytest.approx(row["gbs"] / row["copy_gbs"], rel=0.01)
