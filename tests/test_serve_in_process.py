"""`pd-runtime serve --in-process`: the product without Ray, one process, the same PDWorker,
PoolClient and router (pd_runtime/workers/local_pool.py). Served with the official `openai`
client over HTTP: a short prompt colocated and a long one disaggregated (KV over the
in-process link), each equal to the offline engine's greedy tokens; Ctrl-C ends it cleanly and
no process is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from pd_runtime import LLM, SamplingParams
from tests.chaos_support import processes
from tests.chaos_support.product import free_port, stop_serve, wait_ready

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(240)


def test_serve_in_process_both_paths_match_offline(llama_dir, tmp_path):
    port = free_port()
    engine = {"dtype": "float32", "num_kv_blocks": 256, "num_threads": 1}
    cfg = {"model": llama_dir, "prefill": {"num_workers": 1, "engine": engine},
           "decode": {"num_workers": 1, "engine": engine},
           "router": {"port": port, "routing": {"mode": "auto", "max_local_prefill_tokens": 64}}}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    exe = Path(sys.executable).with_name("pd-runtime")
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([str(exe), "serve", "--in-process", "--config", str(path)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base, tmp_path / "serve.log")
        ray = [p.cmdline for p in processes.tree(proc.pid, session=proc.pid)
               if "ray" in p.cmdline.split()[0]]
        assert not ray, f"--in-process started Ray: {ray}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        short = [11 + i for i in range(20)]
        long = [(7 * i) % 400 + 5 for i in range(150)]
        offline = LLM(llama_dir, dtype="float32", num_kv_blocks=256)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for prompt in (short, long):
            want = offline.generate([prompt], params)[0]
            got = client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert got.choices[0].text == want.text
        metrics = httpx.get(base + "/metrics").text
        assert 'pd_routing_decisions_total{path="disaggregated"' in metrics
        assert 'pd_routing_decisions_total{path="colocated"' in metrics
        # A long prompt scored (echo + logprobs) runs where it is computed: colocated.
        fresh = [(11 * i) % 400 + 3 for i in range(150)]  # nothing of it cached anywhere
        scored = client.completions.create(model=model, prompt=fresh, max_tokens=1,
                                           temperature=0, logprobs=1, echo=True)
        want = offline.generate([fresh], SamplingParams(max_tokens=1, temperature=0,
                                                        prompt_logprobs=1))[0]
        assert scored.choices[0].logprobs.token_logprobs[:len(fresh)] == \
            [None] + [e[t].logprob for t, e in zip(fresh[1:], want.prompt_logprobs[1:])]
        assert _decisions(httpx.get(base + "/metrics").text, "disaggregated") == \
            _decisions(metrics, "disaggregated")
    finally:
        code = stop_serve(proc, timeout_s=30)
        log.close()
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
    time.sleep(0.5)
    left = [p for p in processes.tree(proc.pid, session=proc.pid) if processes.alive(p)]
    assert not left, f"processes left behind: {[(p.pid, p.cmdline[:80]) for p in left]}"


def _decisions(metrics: str, path: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(f'pd_routing_decisions_total{{path="{path}"'))


PYTHONIC = ("{%- if tools %}<|im_start|>system\nCall functions as [func_name1(params_name1="
            "params_value1, params_name2=params_value2...), func_name2(params)]\n"
            "{{ tools | tojson }}<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>"
            "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_serve_takes_vllm_flags(llama_dir, tmp_path):
    """`pd-runtime serve MODEL` with vLLM's flags over a YAML: the model named first, its
    served name, one API key, a chat template from a file (whose tool-call format, pythonic,
    is then read), and max_model_len (a flag that did nothing before) enforced."""
    port = free_port()
    engine = {"dtype": "float32", "num_kv_blocks": 256, "num_threads": 1, "warmup_tokens": 0}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"prefill": {"num_workers": 1, "engine": engine},
                                    "decode": {"num_workers": 1, "engine": engine},
                                    "router": {"port": port}}))
    template = tmp_path / "pythonic.jinja"
    template.write_text(PYTHONIC)
    exe = Path(sys.executable).with_name("pd-runtime")
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        [str(exe), "serve", os.path.relpath(llama_dir, REPO), "--in-process", "--config",
         str(path),
         "--served-model-name", "tiny-llama", "--api-key", "sk-test", "--max-model-len", "400",
         "--chat-template", str(template), "--enable-auto-tool-choice",
         "--kv-offloading-size", "0.01"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base, tmp_path / "serve.log")
        client = openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-llama"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0
                          ).models.list()
        with pytest.raises(openai.BadRequestError) as raised:  # 395 + 10 > 400
            client.completions.create(model="tiny-llama", prompt=[5] * 395, max_tokens=10)
        assert "400" in raised.value.body["message"]
        tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"type": "string"}}}}}]
        done = client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "Time?"}], tools=tools,
            max_tokens=40, temperature=0,
            extra_body={"guided_regex": r"\[get_time\(zone='(utc|cet)'\)\]"})
        (call,) = done.choices[0].message.tool_calls
        assert call.function.name == "get_time" and \
            json.loads(call.function.arguments)["zone"] in ("utc", "cet")
        assert done.choices[0].finish_reason == "tool_calls"
        metrics = httpx.get(base + "/metrics").text  # vLLM's names, the served name on them
        assert 'vllm:num_requests_running{model_name="tiny-llama"}' in metrics
        assert 'vllm:time_to_first_token_seconds_count{model_name="tiny-llama"}' in metrics
        assert 'vllm:prefix_cache_queries_total{model_name="tiny-llama"}' in metrics
        # --kv-offloading-size (GiB): every worker has a host tier below its KV cache.
        tiers = [line for line in metrics.splitlines()
                 if line.startswith('pd_worker_kv_tier{kind="capacity_blocks",tier="host"')]
        assert len(tiers) == 2 and all(float(line.split()[-1]) > 0 for line in tiers)
    finally:
        code = stop_serve(proc, timeout_s=30)
        log.close()
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
