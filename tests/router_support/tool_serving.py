"""Shared by the tool-call tests: a reader fed an output in pieces, the test model served with
a chat template of the test's (in a copy of its directory), and a streamed chat's deltas put
back together."""

from __future__ import annotations

import shutil

import openai

from pd_runtime.parsers.registry import reader
from tests.router_support.serving import local


def streamed(text: str, cuts, plan):
    """(content, [(name, arguments)]) of `plan`'s reader fed `text` up to each cut, then
    whole."""
    r, shown, calls = reader(plan), "", {}
    for end in [*cuts, len(text)]:
        more, deltas = r.feed(text[:end], end == len(text))
        shown += more
        for delta in deltas:
            if "id" in delta:
                assert delta["index"] == len(calls) and delta["type"] == "function"
                calls[delta["index"]] = dict(delta["function"])
            else:
                calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return shown, [(c["name"], c["arguments"]) for c in calls.values()]


def with_template(llama_dir: str, tmp_path_factory, name: str, template: str):
    """(backend, official client) of the test model given `template`; a fixture's body."""
    model = tmp_path_factory.mktemp(name) / "model"
    shutil.copytree(llama_dir, model)
    (model / "chat_template.jinja").write_text(template)
    with local(str(model)) as (backend, port):
        yield backend, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                     max_retries=0)


def assembled(events) -> tuple[str, dict, str]:
    """(content, {index: {"id", "name", "arguments", "pieces"}}, finish_reason) of a stream:
    `pieces` counts the deltas that carried arguments."""
    content, calls, finish = "", {}, None
    for event in events:
        if not event.choices:
            continue
        delta = event.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": "",
                                                 "pieces": 0})
            call["id"] = part.id or call["id"]
            if part.function is not None:
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
                call["pieces"] += bool(part.function.arguments)
        finish = event.choices[0].finish_reason or finish
    return content, calls, finish
