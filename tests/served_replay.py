"""A fixed set of served requests and what the API answered them, recorded once and replayed
by tests/test_served_replay.py: every endpoint kind's bytes must stay as they were.

The set (REQUESTS) covers /v1/completions and /v1/chat/completions streamed and not, greedy
and seeded sampling, logprobs and top_logprobs, echo, stop strings, the length finish, n > 1,
a tool call forced by tool_choice (the grammar makes the tiny model write one), /v1/responses
streamed and not, /v1/models, and invalid requests (their OpenAI error bodies). It runs on
the tiny test model (`make_tiny_model(preset="test", architecture="llama")`) behind one
in-process decode worker, as tests/router_support/serving.py serves it.

Recorded at commit 94602dc (before the OpenAI layer moved out of pd_runtime/router/), every
request kind included:

    git worktree add /tmp/wt-presplit 94602dc
    PYTHONPATH=/tmp/wt-presplit .venv/bin/python tests/served_replay.py --record

(this file imports nothing of tests/, and finds the app under either layout).

What is normalized, and why (nothing else is):
- VOLATILE_KEYS: ids (random per response, item and call) and creation times;
- a stream's chunking: how many tokens one event carries depends on whether the worker's
  outputs queued up while the router read the last one (api.py's merge), and n > 1 choices
  interleave as they are produced. A stream is compared as its events per choice in order,
  consecutive deltas of one choice folded into one (`canonical_stream`), and a Responses
  stream's `sequence_number` counted again after the fold; a streamed completion's
  `logprobs.text_offset` is left out (a token whose bytes end inside a character is placed
  where its chunk's text began, so it moves with the chunking).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import httpx

DATA = Path(__file__).resolve().parent / "data" / "served_replay.json"
MODEL_NAME = "tiny-llama"
VOLATILE_KEYS = frozenset({"id", "created", "created_at", "completed_at", "response_id",
                           "item_id", "call_id"})
HEADERS_KEPT = ("content-type",)

_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
_CHAT = [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Name three colours."}]


def _completion(**body) -> dict:
    return {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 8,
            "temperature": 0, **body}


def _chat(**body) -> dict:
    return {"model": MODEL_NAME, "messages": _CHAT, "max_tokens": 8, "temperature": 0, **body}


# (name, method, path, JSON body or None), sent in this order to one server.
REQUESTS: list[tuple[str, str, str, Optional[dict]]] = [
    ("models", "GET", "/v1/models", None),
    ("completion_greedy", "POST", "/v1/completions", _completion()),
    ("completion_greedy_stream", "POST", "/v1/completions", _completion(stream=True)),
    ("completion_seeded", "POST", "/v1/completions",
     _completion(temperature=0.9, top_p=0.9, seed=1234, max_tokens=12)),
    ("completion_seeded_stream", "POST", "/v1/completions",
     _completion(temperature=0.9, seed=99, max_tokens=12, stream=True)),
    ("completion_logprobs", "POST", "/v1/completions", _completion(logprobs=3)),
    ("completion_logprobs_stream", "POST", "/v1/completions",
     _completion(logprobs=2, stream=True, stream_options={"include_usage": True})),
    ("completion_echo", "POST", "/v1/completions",
     _completion(echo=True, logprobs=1, max_tokens=4)),
    ("completion_token_ids", "POST", "/v1/completions",
     _completion(prompt=[11, 12, 13, 14, 15, 16, 17, 18], ignore_eos=True)),
    ("completion_stop", "POST", "/v1/completions",
     _completion(max_tokens=32, stop=["e", "a"], ignore_eos=True)),
    ("completion_length", "POST", "/v1/completions",
     _completion(max_tokens=3, ignore_eos=True)),
    ("completion_n2_seeded", "POST", "/v1/completions",
     _completion(n=2, temperature=1.0, seed=7, max_tokens=6)),
    ("completion_n2_stream", "POST", "/v1/completions",
     _completion(n=2, temperature=1.0, seed=8, max_tokens=6, stream=True,
                 stream_options={"include_usage": True})),
    ("completion_batch_prompts", "POST", "/v1/completions",
     _completion(prompt=["One", "Two three"], max_tokens=4)),
    ("chat_greedy", "POST", "/v1/chat/completions", _chat()),
    ("chat_greedy_stream", "POST", "/v1/chat/completions",
     _chat(stream=True, stream_options={"include_usage": True})),
    ("chat_seeded", "POST", "/v1/chat/completions",
     _chat(temperature=0.8, seed=42, max_tokens=10)),
    ("chat_top_logprobs", "POST", "/v1/chat/completions",
     _chat(logprobs=True, top_logprobs=3, max_tokens=5)),
    ("chat_top_logprobs_stream", "POST", "/v1/chat/completions",
     _chat(logprobs=True, top_logprobs=2, max_tokens=5, stream=True)),
    ("chat_stop", "POST", "/v1/chat/completions",
     _chat(max_tokens=24, stop=["eck"], ignore_eos=True)),
    ("chat_n2", "POST", "/v1/chat/completions",
     _chat(n=2, temperature=1.0, seed=5, max_tokens=6)),
    ("chat_n2_stream", "POST", "/v1/chat/completions",
     _chat(n=2, temperature=1.0, seed=6, max_tokens=6, stream=True)),
    ("chat_tool_named", "POST", "/v1/chat/completions",
     _chat(tools=[_TOOL], max_tokens=40,
           tool_choice={"type": "function", "function": {"name": "get_weather"}})),
    ("chat_tool_named_stream", "POST", "/v1/chat/completions",
     _chat(tools=[_TOOL], max_tokens=40, stream=True,
           tool_choice={"type": "function", "function": {"name": "get_weather"}})),
    ("responses", "POST", "/v1/responses",
     {"model": MODEL_NAME, "input": "Say hello.", "max_output_tokens": 8, "temperature": 0,
      "store": False}),
    ("responses_stream", "POST", "/v1/responses",
     {"model": MODEL_NAME, "input": "Say hello.", "max_output_tokens": 8, "temperature": 0,
      "stream": True, "store": False}),
    ("invalid_temperature", "POST", "/v1/completions", _completion(temperature=-1)),
    ("invalid_max_tokens", "POST", "/v1/chat/completions", _chat(max_tokens=0)),
    ("invalid_missing_messages", "POST", "/v1/chat/completions",
     {"model": MODEL_NAME, "max_tokens": 4}),
    ("invalid_model", "POST", "/v1/completions", _completion(model="no-such-model")),
    ("invalid_n", "POST", "/v1/completions", _completion(n=0)),
    ("invalid_logprobs", "POST", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=99)),
    ("invalid_too_long", "POST", "/v1/completions", _completion(max_tokens=100000)),
    ("invalid_json", "POST", "/v1/chat/completions", "{not json"),
    ("invalid_stream_error", "POST", "/v1/chat/completions", _chat(stream=True, top_p=0)),
]


# ------------------------------------------------------------------------------- normalizing
def normalize(value: Any) -> Any:
    """`value` with every VOLATILE_KEYS entry's value replaced by a placeholder (the served
    model's name, also an `id`, is not volatile)."""
    if isinstance(value, dict):
        return {k: ("<volatile>" if k in VOLATILE_KEYS and v not in (None, MODEL_NAME)
                    else normalize(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    return value


def parse_sse(text: str) -> list[dict]:
    """A `text/event-stream` body as its events: {"event", "data"} (data parsed as JSON where
    it is JSON; an SSE `id:` line is a resume position, kept only as whether it was there)."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        event: dict = {}
        data = []
        for line in block.split("\n"):
            field, _, rest = line.partition(":")
            rest = rest[1:] if rest.startswith(" ") else rest
            if field == "data":
                data.append(rest)
            elif field == "event":
                event["event"] = rest
            elif field == "id":
                event["has_id"] = True
            elif field:
                event[field] = rest
        raw = "\n".join(data)
        try:
            event["data"] = json.loads(raw)
        except ValueError:
            event["data"] = raw
        events.append(event)
    return events


# The fields a delta adds to (joined when two deltas fold); any other field must agree.
_DELTA_TEXT = frozenset({"text", "content", "arguments", "reasoning_content", "delta"})


def _fold(a: Any, b: Any, key: str = "") -> Any:
    """Two consecutive deltas as one (their text joined, lists joined, index-keyed lists by
    index); raises ValueError where they are not deltas of one thing."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, value in b.items():
            out[k] = _fold(a[k], value, k) if k in a else value
        return out
    if isinstance(a, str) and isinstance(b, str) and key in _DELTA_TEXT:
        return a + b
    if key == "sequence_number":  # a Responses event's place: renumbered after folding
        return a
    if isinstance(a, list) and isinstance(b, list):
        if all(isinstance(x, dict) and "index" in x for x in a + b):
            merged = {x["index"]: x for x in a}
            for x in b:
                merged[x["index"]] = _fold(merged[x["index"]], x) if x["index"] in merged else x
            return [merged[i] for i in sorted(merged)]
        return a + b
    if a is None or b is None:
        return b if a is None else a
    if a == b:
        return a
    raise ValueError(f"not one delta: {key}: {a!r} vs {b!r}")


def _foldable(a: dict, b: dict) -> bool:
    """Whether chunk b continues chunk a's delta (one choice each, a not its last)."""
    if "choices" in a:
        if len(a.get("choices") or []) != 1 or len(b.get("choices") or []) != 1:
            return False
        ca, cb = a["choices"][0], b["choices"][0]
        return ca.get("index") == cb.get("index") and ca.get("finish_reason") is None \
            and not a.get("usage") and not b.get("usage")
    if a.get("type", "").endswith(".delta") and a.get("type") == b.get("type"):
        return all(a.get(k) == b.get(k) for k in ("output_index", "content_index", "item_id"))
    return False


def _choice_of(data: Any) -> Optional[int]:
    if isinstance(data, dict) and len(data.get("choices") or []) == 1:
        return data["choices"][0].get("index")
    return None


def canonical_stream(events: list[dict]) -> list[dict]:
    """A stream's events independent of its chunking: per choice in order (a choice's events
    kept in their order, choice-less ones after the choices), consecutive deltas folded."""
    choices = sorted({c for c in (_choice_of(e.get("data")) for e in events) if c is not None})
    ordered = [e for c in choices for e in events if _choice_of(e.get("data")) == c] + \
        [e for e in events if _choice_of(e.get("data")) is None]
    out: list[dict] = []
    for event in ordered:
        last = out[-1] if out else None
        if last is not None and isinstance(last.get("data"), dict) and \
                isinstance(event.get("data"), dict) and last.get("event") == event.get("event") \
                and _foldable(last["data"], event["data"]):
            try:
                out[-1] = {**last, "data": _fold(last["data"], event["data"])}
                continue
            except ValueError:
                pass
        out.append(event)
    for number, event in enumerate(out):
        if isinstance(event.get("data"), dict) and "sequence_number" in event["data"]:
            event["data"] = {**event["data"], "sequence_number": number}
        for choice in (event.get("data") or {}).get("choices") or [] \
                if isinstance(event.get("data"), dict) else []:
            if isinstance(choice.get("logprobs"), dict) and "text_offset" in choice["logprobs"]:
                choice["logprobs"].pop("text_offset")
    return out


def answer(response: httpx.Response) -> dict:
    """What a response is compared by: status, kept headers, body (normalized)."""
    headers = {h: response.headers.get(h) for h in HEADERS_KEPT if h in response.headers}
    ctype = response.headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        body: Any = {"events": canonical_stream(parse_sse(response.text))}
    elif ctype.startswith("application/json"):
        body = response.json()
    else:
        body = response.text
    return {"status": response.status_code, "headers": headers, "body": normalize(body)}


def replay(base_url: str) -> dict[str, dict]:
    """Send REQUESTS in order; name -> answer."""
    results = {}
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for name, method, path, body in REQUESTS:
            if isinstance(body, str):
                response = client.request(method, path, content=body,
                                          headers={"content-type": "application/json"})
            else:
                response = client.request(method, path, json=body)
            results[name] = answer(response)
    return results


# ------------------------------------------------------------------------------- the server
def _app_modules():
    """create_app and start_in_thread, under the layout of whichever tree is imported."""
    try:
        from pd_runtime.entrypoints.openai.app import create_app
        from pd_runtime.entrypoints.openai.server import start_in_thread
    except ImportError:  # before the OpenAI layer left pd_runtime/router/
        from pd_runtime.router.app import create_app
        from pd_runtime.router.server import start_in_thread
    return create_app, start_in_thread


@contextlib.contextmanager
def served(model_dir: str):
    """The API over one in-process decode worker on the tiny model; yields its base URL."""
    from pd_runtime.config import ClusterConfig, RouterConfig
    from pd_runtime.router.core import PoolBackend
    from pd_runtime.workers.local_pool import LocalPool

    create_app, start_in_thread = _app_modules()
    router = RouterConfig(routing={"mode": "always_colocated"}, served_model_name=MODEL_NAME)
    cfg = ClusterConfig.model_validate({
        "model": model_dir, "router": router.model_dump(), "prefill": {"num_workers": 0},
        "decode": {"num_workers": 1, "engine": {"dtype": "float32", "num_kv_blocks": 256,
                                                 "num_threads": 1}},
        "kv_transfer": {"backend": "local"}})
    pool = LocalPool(cfg, model_dir)
    try:
        backend = PoolBackend(pool, cfg, model_dir)
        backend.start()
        try:
            app = create_app(backend, router, owner=f"served-replay-{os.getpid()}")
            server, port = start_in_thread(app)
            try:
                yield f"http://127.0.0.1:{port}"
            finally:
                server.stop()
                if hasattr(backend, "close"):
                    backend.close()
        finally:
            backend.stop()
    finally:
        pool.close()


def make_model(directory: str) -> str:
    from pd_runtime.model.tiny import make_tiny_model

    return str(make_tiny_model(Path(directory) / MODEL_NAME, preset="test", architecture="llama"))


def main() -> None:
    import pd_runtime
    import torch

    torch.set_num_threads(1)
    print(f"pd_runtime from {pd_runtime.__file__}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("PD_RUNTIME_DATA_DIR", str(Path(tmp) / "data"))
        with served(make_model(tmp)) as base_url:
            results = replay(base_url)
    text = json.dumps(results, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    if "--record" in sys.argv:
        DATA.parent.mkdir(parents=True, exist_ok=True)
        DATA.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
