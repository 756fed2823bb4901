"""Two Ray nodes on one machine (ray.cluster_utils), the pools placed by
cluster_configs/two-node-cpu.yaml: the prefill worker on the node advertising
`pd_prefill_node`, the decode worker on the other, each transfer agent on its own node's
address (`kv_transfer.host: auto`). Served over HTTP with the official `openai` client: the
long prompt's KV crosses from node to node, and both routes equal the offline engine."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from pd_runtime import LLM, SamplingParams

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)
CONFIG = Path(__file__).resolve().parent.parent / "cluster_configs" / "two-node-cpu.yaml"


def test_prefill_and_decode_pools_on_two_nodes(llama_dir):
    from ray.cluster_utils import Cluster

    from pd_runtime.config import ClusterConfig
    from pd_runtime.workers.launch import launch
    from pd_runtime.entrypoints.openai.app import create_app
    from pd_runtime.router.core import PoolBackend
    from pd_runtime.entrypoints.openai.server import start_in_thread

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"pd_prefill_node": 1}, "include_dashboard": False})
    server = backend = None
    try:
        decode_node = cluster.add_node(num_cpus=2, resources={"pd_decode_node": 1})
        cluster.wait_for_nodes()
        raw = yaml.safe_load(CONFIG.read_text())
        raw["model"] = llama_dir
        raw["ray"]["address"] = cluster.address
        for pool in ("prefill", "decode"):
            raw[pool]["engine"] = {"dtype": "float32", "num_kv_blocks": 128, "num_threads": 1,
                                   "warmup_tokens": 0}
        raw["router"] = {"port": 0, "routing": {"mode": "auto", "max_local_prefill_tokens": 64}}
        cfg = ClusterConfig.model_validate(raw)
        client = launch(cfg, llama_dir)

        infos = {w.worker_id: ray.get(w.handle.ready.remote())
                 for w in client.prefill + client.decode}
        assert infos["decode-0"]["node_id"] == decode_node.node_id
        assert infos["prefill-0"]["node_id"] != decode_node.node_id  # the head: pd_prefill_node
        from pd_runtime.kv_transfer.base import AgentMetadata
        from pd_runtime.kv_transfer.group import rank_metadata

        for info in infos.values():  # host "auto" became the node's address
            address = AgentMetadata.decode(rank_metadata(info["kv_metadata"])[0]).address
            assert "auto" not in str(address) and ray.util.get_node_ip_address() in str(address)

        backend = PoolBackend(client, cfg, llama_dir)
        backend.start()
        server, port = start_in_thread(create_app(backend, cfg.router))
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                            max_retries=0)
        model = api.models.list().data[0].id
        offline = LLM(llama_dir, dtype="float32", num_kv_blocks=128)
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        for prompt in ([9 + i for i in range(20)], [(5 * i) % 300 + 7 for i in range(160)]):
            got = api.completions.create(model=model, prompt=prompt, max_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True})
            assert got.choices[0].text == offline.generate([prompt], params)[0].text

        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        routed = dict(re.findall(r'pd_routing_decisions_total\{path="(\w+)",[^}]*\} ([0-9.]+)',
                                 metrics))
        assert float(routed.get("disaggregated", 0)) >= 1 and float(routed.get("colocated", 0)) >= 1
        sent = ray.get(client.prefill[0].handle.load.remote())["kv_transfer"]
        assert sent["bytes_sent"] > 0, sent  # the KV went from the prefill node to the decode node
    finally:
        if server is not None:
            server.stop()
        if backend is not None:
            backend.stop()
        ray.shutdown()
        cluster.shutdown()
