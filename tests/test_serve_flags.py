"""`pd-runtime serve` with vLLM's flags (pd_runtime/serve_flags.py): each sets the config field
it names, over the YAML's, in every pool; vLLM's parser names map to ours; a bad value is an
error naming its flag. (Served end to end: tests/test_serve_in_process.py.)"""

from __future__ import annotations

import pytest

from pd_runtime import serve_flags
from pd_runtime.cli import build_parser
from pd_runtime.config import ClusterConfig


def applied(*argv: str, cfg: ClusterConfig | None = None) -> ClusterConfig:
    args = build_parser().parse_args(["serve", *argv])
    return serve_flags.apply(cfg or ClusterConfig(), args)


def test_each_flag_sets_its_field_in_every_pool(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    cfg = applied("/models/llama", "--max-model-len", "4096", "--dtype", "half", "--seed", "7",
                  "--no-enable-prefix-caching", "--max-num-seqs", "32",
                  "--max-num-batched-tokens", "1024", "--block-size", "32",
                  "--kv-cache-dtype", "int8", "--served-model-name", "llama",
                  "--api-key", "sk-1", "--chat-template", str(template),
                  "--tool-call-parser", "llama4_pythonic", "--enable-auto-tool-choice",
                  "--reasoning-parser", "deepseek_r1", "--generation-config", "vllm",
                  "--enforce-eager", "-tp", "1", "--trust-remote-code",
                  "--gpu-memory-utilization", "0.85", "--swap-space", "4",
                  "--disable-log-requests", "--disable-log-stats",
                  "--uvicorn-log-level", "warning")
    for pool in (cfg.prefill, cfg.decode, cfg.colocated):
        e = pool.engine
        assert (e.max_model_len, e.dtype, e.seed, e.enable_prefix_caching, e.max_num_seqs,
                e.max_num_batched_tokens, e.block_size, e.kv_cache_dtype, e.cuda_graphs,
                e.gpu_memory_utilization, e.swap_space_bytes) == \
            (4096, "float16", 7, False, 32, 1024, 32, "int8", False, 0.85, 4 << 30)
    r = cfg.router
    assert (r.served_model_name, r.tool_call_parser, r.reasoning_parser, r.sampling_defaults,
            r.log_requests) == ("llama", "pythonic", "think", "openai", False)
    assert ClusterConfig().router.log_requests  # on by default
    gpt_oss = applied("--tool-call-parser", "openai", "--reasoning-parser", "openai_gptoss").router
    assert (gpt_oss.tool_call_parser, gpt_oss.reasoning_parser) == ("harmony", "harmony")
    cors = applied("--allowed-origins", '["https://app.example"]', "--allow-credentials",
                   "--allowed-methods", '["GET", "POST"]', "--allowed-headers",
                   '["Authorization"]').router.cors
    assert (cors.allowed_origins, cors.allow_credentials, cors.allowed_methods,
            cors.allowed_headers) == (["https://app.example"], True, ["GET", "POST"],
                                      ["Authorization"])
    assert ClusterConfig().router.cors.allowed_origins == ["*"]  # vLLM's default
    with pytest.raises(SystemExit):  # argparse: not a JSON list of strings
        build_parser().parse_args(["serve", "--allowed-origins", "https://app.example"])
    assert not applied("--disable-uvicorn-access-log").router.log_requests
    assert [(t.tenant_id, t.api_key) for t in r.tenants] == [("default", "sk-1")]
    keys = applied("--api-key", "a", "b").router.tenants
    assert [(t.tenant_id, t.api_key, t.share_prefix_cache) for t in keys] == \
        [("default", "a", True), ("default-2", "b", True)]
    # The model given first is served under its argument, as vLLM names it.
    assert applied("/models/Llama-3.2-1B").router.served_model_name == "/models/Llama-3.2-1B"
    assert applied("--model", "/models/x").router.served_model_name is None  # (basename)
    offload = applied("--kv-offloading-size", "2.5")
    assert {p.engine.kv_offloading_size for p in offload.pools().values()} == {2.5}
    assert r.chat_template_text() == template.read_text()
    assert applied("--chat-template", "{{ messages }}").router.chat_template_text() == \
        "{{ messages }}"


def test_no_flags_keep_the_config_and_flags_win_over_it():
    base = ClusterConfig.model_validate({"decode": {"engine": {"max_model_len": 512}},
                                         "router": {"served_model_name": "file"}})
    assert applied(cfg=base) is base
    cfg = applied("--max-model-len", "256", cfg=base)
    assert cfg.decode.engine.max_model_len == 256 and cfg.router.served_model_name == "file"
    for parser in serve_flags.TOOL_CALL_PARSERS:
        assert applied("--tool-call-parser", parser).router.tool_call_parser == \
            serve_flags.TOOL_CALL_PARSERS[parser]


@pytest.mark.parametrize("argv, says", [
    (["--max-model-len", "0"], "--max-model-len: "),
    (["--block-size", "0"], "--block-size: "),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template: "),
    (["--served-model-name", ""], "--served-model-name: "),
    (["--api-key", ""], "--api-key: "),
    (["--served-model-name", "a", "b"], "--served-model-name: one name"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: "),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization: "),
    (["--swap-space", "-1"], "--swap-space: "),
    (["--swap-space", "inf"], "--swap-space: "),
    (["--swap-space", "nan"], "--swap-space: "),
    (["--kv-offloading-size", "-1"], "--kv-offloading-size: "),
    (["--kv-offloading-size", "nan"], "--kv-offloading-size: "),
])
def test_a_bad_value_names_its_flag(argv, says):
    with pytest.raises(ValueError) as raised:
        applied(*argv)
    assert str(raised.value).startswith(says), raised.value


def test_tensor_parallel_size_sets_every_pool(tmp_path):
    """`-tp 2` as vLLM spells it: every pool's workers are 2 ranks. In one process
    (--in-process: KV over in-process links, which cannot reach a worker's other ranks) the
    default deployment drops its prefill pool, and a config that keeps one is refused at
    start, naming the field."""
    from pd_runtime.workers.pool import check_tensor_parallel

    cfg = applied("-tp", "2")
    assert {p.engine.tensor_parallel_size for p in cfg.pools().values()} == {2}
    assert cfg.prefill.num_workers == 1  # on Ray every rank pair is linked
    check_tensor_parallel(cfg)
    alone = applied("-tp", "2", "--in-process")
    assert alone.prefill.num_workers == 0 and alone.decode.num_workers == 1
    path = tmp_path / "c.yaml"
    path.write_text("prefill: {num_workers: 1}\nkv_transfer: {backend: local}\n")
    kept = applied("--config", str(path), "-tp", "2", "--in-process", cfg=ClusterConfig(
        kv_transfer={"backend": "local"}))
    assert kept.prefill.num_workers == 1
    with pytest.raises(ValueError, match=r"prefill.engine.tensor_parallel_size: 2 with a prefill "
                                         r"pool over kv_transfer.backend 'local'"):
        check_tensor_parallel(kept)


def test_conflicts_are_errors():
    args = build_parser().parse_args(["serve", "/a", "--model", "/b"])
    with pytest.raises(ValueError, match="given twice"):
        serve_flags.model_dir(args)
    assert serve_flags.model_dir(build_parser().parse_args(["serve", "/a"])) == "/a"
    assert serve_flags.model_dir(build_parser().parse_args(["serve", "--model", "/b"])) == "/b"
    keyed = ClusterConfig.model_validate({"router": {"tenants": [
        {"tenant_id": "t", "api_key": "k"}]}})
    with pytest.raises(ValueError, match="--api-key: the config already names its tenants"):
        applied("--api-key", "x", cfg=keyed)
    with pytest.raises(ValueError, match="--tensor-parallel-size: "):
        applied("--tensor-parallel-size", "0")
    # Several keys stay keys: the last is not taken for the model (and echoed in an error).
    args = build_parser().parse_args(["serve", "--api-key", "sk-a", "sk-b"])
    assert args.api_key == ["sk-a", "sk-b"] and args.model_path is None
    with pytest.raises(SystemExit):  # argparse: a parser vLLM has and we do not read
        build_parser().parse_args(["serve", "--tool-call-parser", "kimi_k2"])


def test_a_broken_template_fails_at_start(llama_dir):
    from pd_runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(llama_dir)
    with pytest.raises(ValueError, match="router.chat_template: the template does not compile"):
        tokenizer.use_chat_template("{% for m in messages %}{{ m.content }}")
    tokenizer.use_chat_template("[func_name1(params_name1=params_value1)] {{ messages[0].content }}")
    assert tokenizer.tool_call_format == "pythonic"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith(" hi")


def test_a_relative_draft_model_is_made_absolute(tmp_path, monkeypatch):
    (tmp_path / "draft").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = ClusterConfig.model_validate({"decode": {"engine": {"speculative_method": "draft",
                                                              "speculative_model": "draft"}}})
    fixed = serve_flags.absolute_draft_models(cfg)
    assert fixed.decode.engine.speculative_model == str(tmp_path / "draft")
    assert fixed.prefill == cfg.prefill


@pytest.mark.parametrize("log_requests", [True, False])
def test_disable_log_requests_leaves_out_the_line_per_request(llama_dir, caplog, log_requests):
    """router.log_requests (--disable-log-requests): served over HTTP, a request logs its id,
    method, path and status, or nothing; it keeps its X-Request-Id either way."""
    import httpx

    from pd_runtime.config import RouterConfig
    from tests.router_support.serving import local

    config = RouterConfig(routing={"mode": "always_colocated"}, log_requests=log_requests)
    # The server stops (its request handled to the end) before the log is read.
    with caplog.at_level("INFO", logger="router.http"), local(llama_dir, config) as (_, port):
        response = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)
        request_id = response.headers["x-request-id"]
    assert response.status_code == 200 and request_id.startswith("req-")
    lines = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
    assert lines == ([f"{request_id} GET /v1/models 200 " + lines[0].split()[-1]]
                     if log_requests else []), lines


@pytest.mark.parametrize("origins", [["*"], ["https://app.example"], []])
def test_browsers_cross_origin_requests_are_answered_as_configured(llama_dir, origins):
    """router.cors over real HTTP: a preflight is answered before the API key is asked for,
    and a response carries the allowed origin; an origin not listed, or cors off, gets no
    CORS headers (the browser then refuses the response)."""
    import httpx

    from pd_runtime.config import RouterConfig
    from tests.router_support.serving import local

    config = RouterConfig(routing={"mode": "always_colocated"}, cors={"allowed_origins": origins},
                          tenants=[{"tenant_id": "t", "api_key": "sk-t"}])
    page = "https://app.example"
    with local(llama_dir, config) as (_, port):
        base = f"http://127.0.0.1:{port}/v1"
        preflight = httpx.options(base + "/chat/completions", headers={
            "Origin": page, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"}, timeout=30)
        listed = httpx.get(base + "/models", headers={"Origin": page,
                                                      "Authorization": "Bearer sk-t"},
                           timeout=30)
        other = httpx.get(base + "/models", headers={"Origin": "https://elsewhere.example",
                                                     "Authorization": "Bearer sk-t"},
                          timeout=30)
    assert listed.status_code == other.status_code == 200
    allow = listed.headers.get("access-control-allow-origin")
    if not origins:
        assert allow is None and "access-control-allow-origin" not in preflight.headers
        return
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] in ("*", page)
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert allow == ("*" if origins == ["*"] else page)
    assert other.headers.get("access-control-allow-origin") == (
        "*" if origins == ["*"] else None)
