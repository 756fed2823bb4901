"""A streamed tool call as a client gets it, for the source tree given: how soon its arguments
begin to arrive (the token at which the first arguments delta is sent, of the output's tokens)
and what reading the call costs the router per token, against the same chunks streamed as
plain chat content in the same run. Run it on two trees (a `git worktree` of the commit before
a change, and this one) to compare.

    .venv/bin/python bench/tool_call_stream.py [--tree DIR] [--chars 8000] [--repeats 7]
                                               [--format hermes|qwen3_coder|pythonic]

The output: a short preamble, then one call in the Hermes format (Qwen2.5/Qwen3), or with
--format qwen3_coder in Qwen3-Coder's XML form, or with --format pythonic as a Python call (no
preamble: the call is the whole output there), whose arguments carry a file's text of --chars
characters (an agent writing a file), tokenized by the bench model's tokenizer, one token per
chunk; the request prepared by the router's own code as
the official client sends it (`stream: true`, tools, tool_choice auto), against a chat template
that shows that format.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TEMPLATE = ("{% if tools %}<tools>{{ tools | tojson }}</tools> Call as <tool_call>{}</tool_call>"
            "{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "<|assistant|>")
TOOL = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"},
                                     "content": {"type": "string"}}}}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--chars", type=int, default=8000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--format", choices=("hermes", "qwen3_coder", "pythonic"), default="hermes")
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    from bench.common import bench_model, machine_line
    from pd_runtime.tokenizer import Tokenizer
    try:
        from pd_runtime.entrypoints.openai.request_parsing.protocol import prepare_chat
        from pd_runtime.entrypoints.openai.completion_bodies import ResponseBuilder
    except ImportError:  # a tree from before the HTTP layer left pd_runtime/router/
        from pd_runtime.router.protocol import prepare_chat
        from pd_runtime.router.responses import ResponseBuilder
    try:
        from pd_runtime.api import StreamChunk
    except ImportError:  # a tree from before the typed chunk: its builder reads dicts
        StreamChunk = dict

    tokenizer = Tokenizer(bench_model(None))
    tokenizer.chat_template, tokenizer._template = TEMPLATE, None
    tokenizer.tool_call_format = args.format
    body = "".join(f"line {i}: x = {i}\n" for i in range(args.chars // 12))[:args.chars]
    if args.format == "hermes":
        text = ('I will write it. <tool_call>\n{"name": "write_file", "arguments": '
                + json.dumps({"path": "notes.txt", "content": body}) + "}\n</tool_call>")
    elif args.format == "pythonic":
        text = f"[write_file(path='notes.txt', content={body!r})]"
    else:
        text = ("I will write it.\n\n<tool_call>\n<function=write_file>\n<parameter=path>\n"
                f"notes.txt\n</parameter>\n<parameter=content>\n{body}\n</parameter>\n"
                "</function>\n</tool_call>")
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode(ids[:i + 1]) for i in range(len(ids))]
    chunks = [StreamChunk(text=b[len(a):], token_ids=[t], finished=i == len(ids) - 1,
                          finish_reason="stop" if i == len(ids) - 1 else None)
              for i, (a, b, t) in enumerate(zip([""] + pieces, pieces, ids))]
    messages = [{"role": "user", "content": "Save my notes."}]

    def prepared(tools: bool):
        data = {"messages": messages, "stream": True, **({"tools": [TOOL]} if tools else {})}
        return prepare_chat(data, tokenizer, "m", 1 << 20)

    def run(plan) -> tuple[float, int, str]:
        builder = ResponseBuilder(plan, "chatcmpl-x", tokenizer)
        first, arguments = -1, ""
        start = time.perf_counter()
        for i, chunk in enumerate(chunks):
            event = builder.add(0, chunk)
            for call in (event["choices"][0]["delta"].get("tool_calls") or ()) if event else ():
                piece = call["function"].get("arguments") or ""
                if piece and first < 0:
                    first = i
                arguments += piece
        return time.perf_counter() - start, first, arguments

    with_tools, plain = prepared(True), prepared(False)
    best = {"tools": float("inf"), "plain": float("inf")}
    for _ in range(args.repeats):
        for kind, plan in (("tools", with_tools), ("plain", plain)):
            elapsed, first, arguments = run(plan)
            best[kind] = min(best[kind], elapsed)
            if kind == "tools":
                assert json.loads(arguments)["content"] == body, "the arguments differ"
                first_at = first
    per = {k: v / len(chunks) * 1e6 for k, v in best.items()}
    print(machine_line())
    print(f"{args.tree}: {args.format}, {len(chunks)} tokens ({len(text)} characters), best of "
          f"{args.repeats}")
    print(f"first arguments delta at token {first_at} of {len(chunks)}")
    print(f"us/token: with tools {per['tools']:.2f}, plain content {per['plain']:.2f}, "
          f"ratio {per['tools'] / per['plain']:.2f}")


if __name__ == "__main__":
    main()
