"""What the router accepts, over real HTTP on 127.0.0.1: body size limits, large bodies prepared
off the event loop (GET /health keeps answering), text that is not Unicode, OpenAI fields this
server does not implement, and penalties and logit_bias passed through to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_runtime import LLM, SamplingParams
from pd_runtime.config import RouterConfig
from pd_runtime.entrypoints.openai.request_parsing.intake import INLINE_MAX_BYTES, Intake
from pd_runtime.entrypoints.openai.request_parsing.text_checks import lone_surrogate_field, min_tokens
from pd_runtime.tokenizer import Tokenizer
from tests.router_support.scripted_backend import ScriptedBackend, token_chunk
from tests.router_support.served_model import server  # noqa: F401  (a fixture)
from tests.router_support.serving import APPS, ENGINE, assert_error_body, serving

POLLER = Path(__file__).parent / "router_support" / "health_poller.py"
POSTER = Path(__file__).parent / "router_support" / "post_body.py"
MB = 1_000_000
IDLE_BASELINE_MAX_S = 8.0


@pytest.fixture(scope="module")
def url(server):
    return f"http://127.0.0.1:{server[1]}"


@contextlib.contextmanager
def health_polls(port: int):
    """Latencies of GET /health polled from another process while the block runs."""
    proc = subprocess.Popen([sys.executable, str(POLLER), str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    polls: list = []
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield polls
        out, _ = proc.communicate("stop\n", timeout=60)
        polls.extend(json.loads(out))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_twenty_megabyte_bodies_do_not_stall_health(server, tmp_path):
    _, port = server
    intake = APPS[port].state.intake
    # Each ~21 MB and far beyond the 2048-token context. Written as JSON text: a Python list of
    # 7M ints in this process would make every garbage collection here (and so the server on
    # its thread) walk 7M entries, a stall of the test's own making.
    ids = "[" + "17, " * 6_999_999 + "17]"
    bodies = [
        ("/v1/completions", '{"prompt": "' + "lorem ipsum " * 1_750_000 + '", "max_tokens": 4}',
         "prompt"),
        ("/v1/completions", '{"prompt": ' + ids + ', "max_tokens": 4}', "prompt"),
        ("/v1/chat/completions",
         '{"messages": [{"role": "user", "content": "' + "dolor " * 3_500_000 + '"}]}',
         "messages")]
    sends = []
    for i, (path, body, param) in enumerate(bodies):
        file = tmp_path / f"body{i}.json"
        file.write_text(body)
        assert 20 * MB < file.stat().st_size < 32 * 1024 * 1024
        sends.append((path, param, file))
    del ids, bodies
    # Each poll sent while a body is read and parsed must answer within 100 ms of the slowest
    # idle poll of as long a stretch, measured in the same run (the box is shared: a busy core
    # delays any poll by itself). Parsing on the event loop stalled them for 19-26 s. A round
    # that misses is run once more, from a fresh parser process as the first was.
    for attempt in range(2):
        intake.close()  # the first body of the round starts the parser process again
        in_child = intake.prepared_in_child
        idle, during, slowest = _polls_around(port, sends)
        assert intake.prepared_in_child == in_child + len(sends)
        print(f"/health latency, idle: max {max(idle) * 1e3:.1f} ms, median "
              f"{statistics.median(idle) * 1e3:.1f} ms ({len(idle)} polls); under 21 MB bodies: "
              f"max {max(during) * 1e3:.1f} ms, median {statistics.median(during) * 1e3:.1f} ms "
              f"({len(during)} polls)")
        if max(during) < 0.1 + max(idle):
            break
    for _, _, file in sends:
        file.unlink()
    assert max(during) < 0.1 + max(idle), (slowest, sorted(idle)[-3:])


def _polls_around(port: int, sends: list) -> tuple[list, list, tuple]:
    """Polls of /health: idle ones (before and after), those sent while each body was in
    flight, and the slowest of those (latency, seconds into its body, which body)."""
    windows = []
    with health_polls(port) as polls:
        time.sleep(0.5)
        for path, param, file in sends:
            # Sent from another process: the test holds no GIL meanwhile.
            poster = subprocess.Popen([sys.executable, str(POSTER), str(port), path, str(file)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert poster.stdout.readline().strip() == "ready"
            start = time.monotonic()
            out, _ = poster.communicate("go\n", timeout=300)
            windows.append((start, time.monotonic()))
            status, answer = out.split("\n", 1)
            assert status == "400", out[:300]
            error = json.loads(answer)["error"]
            assert error["param"] == param and error["code"] == "context_length_exceeded", error
        idle_from = time.monotonic()
        time.sleep(min(sum(end - start for start, end in windows), IDLE_BASELINE_MAX_S))
    during = [latency for sent, latency in polls
              if any(start <= sent <= end for start, end in windows)]
    idle = [latency for sent, latency in polls if sent < windows[0][0] or sent > idle_from]
    assert len(idle) >= 20 and len(during) >= len(sends), (len(idle), len(during))
    slowest = max((latency, sent - start, n) for sent, latency in polls
                  for n, (start, end) in enumerate(windows) if start <= sent <= end)
    return idle, during, slowest


def test_bodies_over_the_limit_are_413_before_parsing(tokenizer):
    limit = 8192
    backend = ScriptedBackend(tokenizer, [token_chunk("a", finished=True)])
    with serving(backend, RouterConfig(max_request_body_bytes=limit)) as (_, port):
        # Content-Length alone: the answer comes before any of the body is sent.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
            answer = b""
            while b"body_too_large" not in answer:
                part = sock.recv(65536)
                assert part, answer
                answer += part
        assert answer.startswith(b"HTTP/1.1 413"), answer

        def chunked(total: int):  # no Content-Length: the bytes are counted as they arrive
            yield b'{"prompt": "x"'
            for _ in range(total // 1024):
                yield b" " * 1024  # JSON whitespace: valid however long
            yield b"}"

        url = f"http://127.0.0.1:{port}/v1/completions"
        assert_error_body(httpx.post(url, content=chunked(limit + 1024)), 413)
        assert httpx.post(url, content=chunked(limit - 1024)).status_code == 200


def test_a_client_leaving_mid_body_is_a_disconnect_not_an_error(tokenizer):
    backend = ScriptedBackend(tokenizer, [token_chunk("a", finished=True)])
    with serving(backend) as (_, port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 100000\r\n\r\n" + b" " * 1000)
            time.sleep(0.2)
        end = time.monotonic() + 5
        while not backend.observed and time.monotonic() < end:
            time.sleep(0.01)
    assert [e["status"] for e in backend.observed] == [499], backend.observed


def test_large_valid_bodies_are_served_from_the_parser_process(server, url):
    backend, port = server
    intake = APPS[port].state.intake
    prompts = [[(7 * i + j) % 500 + 1 for j in range(300)] for i in range(24)]
    body = {"prompt": prompts, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    pad = {"padding": "p" * INLINE_MAX_BYTES}  # an unknown field: ignored, but makes it large
    in_child, inline_ids = intake.prepared_in_child, intake.prepared_inline_ids
    with httpx.Client(base_url=url, timeout=120) as http:
        batch = http.post("/v1/completions", json=body).json()  # token ids: nothing to tokenize
        assert intake.prepared_inline_ids == inline_ids + 1
        assert batch["usage"]["prompt_tokens"] == 24 * 300
        for i in (0, 13, 23):
            one = http.post("/v1/completions", json={**body, "prompt": prompts[i]}).json()
            assert batch["choices"][i]["text"] == one["choices"][0]["text"]
        text = {"prompt": "hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
        for path, small in (("/v1/completions", text), ("/v1/chat/completions", chat)):
            inline = http.post(path, json=small).json()
            padded = http.post(path, json={**small, **pad}).json()
            assert padded["choices"] == inline["choices"] and padded["usage"] == inline["usage"]
            assert_error_body(http.post(path, json={**small, **pad, "n": 0}), 400, "n")
    assert intake.prepared_in_child == in_child + 4  # the padded text bodies


def _parser_processes() -> set[int]:
    """Child processes of this one that run a spawned multiprocessing worker."""
    children = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended since the listing
            children.update(int(pid) for pid in (task / "children").read_text().split())
    found = set()
    for pid in children:
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
    return found


def test_a_dead_parser_process_is_a_503_then_replaced_and_none_outlives_the_app(tokenizer):
    backend = ScriptedBackend(tokenizer, [token_chunk("a", finished=True)])
    body = {"prompt": "x", "padding": "p" * INLINE_MAX_BYTES}
    before = _parser_processes()
    # Run records off: their writer is a spawned child process too, not the one counted here.
    with serving(backend, RouterConfig(runs={"enabled": False})) as (_, port):
        url = f"http://127.0.0.1:{port}/v1/completions"
        assert httpx.post(url, json=body, timeout=60).status_code == 200
        (child,) = _parser_processes() - before
        os.kill(child, signal.SIGKILL)
        time.sleep(0.5)  # the pool notices its worker is gone
        refused = httpx.post(url, json=body, timeout=60)
        assert_error_body(refused, 503)
        assert refused.headers["retry-after"] == "1"
        assert httpx.post(url, json=body, timeout=60).status_code == 200
        (replacement,) = _parser_processes() - before
        assert replacement != child
    assert not _parser_processes() - before  # stopping the app stopped its parser process


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return Tokenizer(llama_dir)


def test_the_parser_process_gets_a_tokenizer_whose_template_was_compiled(llama_dir):
    tokenizer = Tokenizer(llama_dir)
    messages = [{"role": "user", "content": "hello"}]
    want = tokenizer.encode_chat(messages)  # compiles the template: not picklable as it is
    backend = ScriptedBackend(tokenizer, [])
    intake = Intake(backend, 1 << 20)
    body = json.dumps({"messages": messages, "max_tokens": 2, "padding": "p" * INLINE_MAX_BYTES})
    try:
        prepared = asyncio.run(intake.prepare("chat", bytearray(body.encode())))
    finally:
        intake.close()
    assert intake.prepared_in_child == 1 and prepared.prompts == [want]


def test_lone_surrogates_are_400_and_pairs_are_text(url):
    cases = [("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
             ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
             ("/v1/completions", '{"prompt": "x", "stop": ["\\ud83d"], "max_tokens": 2}', "stop"),
             ("/v1/chat/completions",
              '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
             ("/v1/completions", '{"prompt": "x", "\\ud800": 1}', "\\ud800")]
    for path, raw, param in cases:
        error = assert_error_body(httpx.post(url + path, content=raw.encode()), 400)
        assert error["param"] == param and "surrogate" in error["message"], error
    pair = httpx.post(url + "/v1/completions",
                      content=b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert pair.status_code == 200, pair.text
    for constant in (b"NaN", b"Infinity", b"-Infinity"):
        raw = b'{"prompt": "x", "temperature": ' + constant + b"}"
        assert_error_body(httpx.post(url + "/v1/completions", content=raw), 400)


UNIMPLEMENTED = [  # (field, a value that would need the feature, values that mean "off")
    ("best_of", 3, [None, 1]),
    ("suffix", "tail", [None, ""]),
    # On chat completions these are tool calling (tests/test_http_tools.py).
    ("tools", [{"type": "function", "function": {"name": "f"}}], [None, []]),
    ("tool_choice", "auto", [None, "none"]),
    ("parallel_tool_calls", False, [None, True]),
    ("functions", [{"name": "f"}], [None, []]),
    ("function_call", "auto", [None, "none"]),
    ("modalities", ["text", "audio"], [None, ["text"]]),
    ("audio", {"voice": "x"}, [None]),
    ("prediction", {"type": "content", "content": "x"}, [None]),
    ("reasoning_effort", "high", [None]),
    ("web_search_options", {}, [None]),
]


@pytest.mark.parametrize("field, on, offs", UNIMPLEMENTED)
def test_unimplemented_fields_are_refused_unless_off(url, field, on, offs):
    bodies = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 2}}
    if field in ("tools", "tool_choice", "parallel_tool_calls"):
        del bodies["/v1/chat/completions"]
    with httpx.Client(base_url=url, timeout=60) as http:
        for path, body in bodies.items():
            error = assert_error_body(http.post(path, json={**body, field: on}), 400, field)
            assert error["code"] == "unsupported_parameter"
            for off in offs:
                response = http.post(path, json={**body, field: off})
                assert response.status_code == 200, (field, off, response.text)
    if field == "best_of":  # best_of equal to n is n choices
        got = httpx.post(url + "/v1/completions",
                         json={"prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 2}).json()
        assert len(got["choices"]) == 2


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, **ENGINE)


def test_penalties_and_logit_bias_reach_the_engine(server, url, offline):
    backend, port = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    prompt = [100, 7, 8]
    knobs = dict(frequency_penalty=1.5, presence_penalty=-0.5, logit_bias={"6": 3.0})
    got = client.completions.create(model=backend.model_name, prompt=prompt, max_tokens=16,
                                    temperature=0, extra_body={"ignore_eos": True,
                                                               "repetition_penalty": 1.3},
                                    **knobs)
    want = offline.generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                     ignore_eos=True, repetition_penalty=1.3,
                                                     **knobs))[0]
    plain = offline.generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                      ignore_eos=True))[0]
    assert got.choices[0].text == want.text != plain.text
    chat = client.chat.completions.create(
        model=backend.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, logit_bias={"77": 100}, logprobs=True, extra_body={"ignore_eos": True})
    forced = backend.tokenizer.decode([77], skip_special_tokens=False)
    assert [e.token for e in chat.choices[0].logprobs.content] == [forced] * 6
    vocab = backend.tokenizer.vocab_size
    for bias in ({str(vocab): 1}, {"-1": 1}, {"x": 1}, {"5": 100.5}, {"5": "1"}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=backend.model_name, prompt="x", max_tokens=2,
                                      logit_bias=bias)
        assert caught.value.body["param"] == "logit_bias", bias
    for field, value in (("frequency_penalty", 2.5), ("presence_penalty", -3),
                         ("repetition_penalty", 0), ("frequency_penalty", "1")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=backend.model_name, prompt="x", max_tokens=2,
                                      extra_body={field: value})
        assert caught.value.body["param"] == field


_FOLDING = ["\u03a9\u0314\u0342\u0345", "e\u0301", "\u1100\u1161\u11a8", "a\u0308\u0304"]


def test_the_length_bound_never_exceeds_the_real_token_count(tokenizer):
    pieces = [tokenizer.decode([t], skip_special_tokens=False)
              for t in range(tokenizer.vocab_size)]
    longest = sorted(pieces, key=len)[-40:]  # the text that packs most characters per token

    @settings(max_examples=150, derandomize=True, database=None, deadline=None)
    @given(st.lists(st.one_of(st.sampled_from(longest), st.sampled_from(_FOLDING),
                              st.text(max_size=12)), max_size=120))
    def check(parts):
        text = "".join(parts)
        assert min_tokens(text, tokenizer, 1) <= len(tokenizer.encode(text)), text

    check()
    # And it does refuse: a text of megabytes is known to be too long without tokenizing it.
    assert min_tokens("lorem ipsum " * 100_000, tokenizer, 2048) >= 2048


def test_the_raw_surrogate_scan_agrees_with_the_parsed_strings():
    pieces = st.sampled_from(["a", "\\", "\\\\", "\ud83d", "\ude00", "\ud83d\ude00", "é", '"',
                              "u", "d800", "\\ud800"])

    @settings(max_examples=300, derandomize=True, database=None, deadline=None)
    @given(st.lists(st.lists(pieces, max_size=6).map("".join), max_size=4))
    def check(texts):
        raw = json.dumps({"prompt": texts}).encode()
        data = json.loads(raw)
        lone = any(0xD800 <= ord(c) <= 0xDFFF for text in data["prompt"] for c in text)
        assert (lone_surrogate_field(raw, data) == "prompt") == lone, raw

    check()
