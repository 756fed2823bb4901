"""A reasoning model's thinking split from its answer (pd_runtime/parsers/reasoning.py): the split
itself, the stream of deltas against the whole answer through the router's ResponseBuilder (with and
without tools), and over HTTP with templates that open the think block in the output (Qwen3's
way) or in the prompt (DeepSeek-R1's)."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.api import StreamChunk
from pd_runtime.entrypoints.openai.completion_bodies import ResponseBuilder
from pd_runtime.entrypoints.openai.request_parsing.schema import ChoiceSpec, InvalidRequest, PreparedRequest
from pd_runtime.entrypoints.openai.request_parsing.tools import ToolPlan
from pd_runtime.parsers.reasoning import opens_in_prompt, split
from pd_runtime.tokenizer import Tokenizer
from tests.router_support.serving import ENGINE, local


@pytest.mark.parametrize("text, open_at_start, reasoning, content", [
    ("<think>\nweigh it\n</think>\n\nThe answer.", False, "\nweigh it\n", "\n\nThe answer."),
    ("  <think>a</think>b", False, "a", "b"),
    ("The answer, no thinking.", False, None, "The answer, no thinking."),
    ("<think>cut short", False, "cut short", ""),
    ("weigh it\n</think>\n\nThe answer.", True, "weigh it\n", "\n\nThe answer."),
    ("still thinking", True, "still thinking", ""),
    ("<think>again</think>done", True, "again", "done"),  # the tag written once more
])
def test_split(text, open_at_start, reasoning, content):
    assert split(text, open_at_start) == (reasoning, content)


def test_the_prompt_opens_a_block_only_at_its_end():
    assert opens_in_prompt("<|User|>hi<|Assistant|><think>\n")
    assert not opens_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_in_prompt("no thinking here")
    # A user's text that mentions the tag, left open, is no block of the template's.
    assert not opens_in_prompt("<|im_start|>system\nReason inside <think> tags.<|im_end|>\n"
                               "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return Tokenizer(llama_dir)


def _built(tokenizer, text: str, open_at_start: bool, tools=None, pieces=3):
    """The stream events and the final body of a chat answer `text` arriving in chunks."""
    prepared = PreparedRequest("chat", "m", [[1]], [ChoiceSpec(0, 0, SamplingParams())], True,
                               False, 0, None, tools=tools, reasoning=open_at_start)
    builder = ResponseBuilder(prepared, "id", tokenizer)
    cuts = sorted({0, len(text), *range(0, len(text), pieces)})
    events = []
    for a, b in zip(cuts, cuts[1:]):
        event = builder.add(0, StreamChunk(text=text[a:b], token_ids=[7],
                                           finished=b == len(text), finish_reason="stop"))
        if event is not None:
            events.append(event["choices"][0])
    return events, builder.final_body()["choices"][0]


@pytest.mark.parametrize("pieces", [1, 2, 5])
@pytest.mark.parametrize("open_at_start", [False, True])
def test_streamed_deltas_add_up_to_the_answer(tokenizer, pieces, open_at_start):
    text = "<think>\nfirst this, then that\n</think>\n\nThe answer is 4."
    events, final = _built(tokenizer, text, open_at_start, pieces=pieces)
    assert final["message"] == {"role": "assistant", "reasoning": "\nfirst this, then that\n",
                                "content": "\n\nThe answer is 4."}
    reasoning = "".join(e["delta"].get("reasoning", "") for e in events)
    content = "".join(e["delta"].get("content") or "" for e in events)
    assert reasoning == final["message"]["reasoning"]
    assert content == final["message"]["content"]
    assert all("<think" not in (e["delta"].get("content") or "") and
               "</" not in e["delta"].get("reasoning", "") for e in events)


def test_tool_calls_are_read_from_the_answer_not_the_thinking(tokenizer):
    text = ('thinking of <tool_call>{"name": "f", "arguments": {}}</tool_call>\n</think>\n'
            'Calling. <tool_call>\n{"name": "g", "arguments": {"x": 1}}\n</tool_call>')
    events, final = _built(tokenizer, text, True, tools=ToolPlan("auto", parser="hermes"),
                           pieces=4)
    message = final["message"]
    assert final["finish_reason"] == "tool_calls"
    assert message["reasoning"].startswith("thinking of <tool_call>")
    assert message["content"] == "\nCalling. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("g", {"x": 1})]
    streamed = [c for e in events for c in e["delta"].get("tool_calls") or []]
    assert [c["function"].get("name") for c in streamed if "id" in c] == ["g"]
    assert "".join(c["function"]["arguments"] for c in streamed) == \
        message["tool_calls"][0]["function"]["arguments"]
    assert "".join(e["delta"].get("content") or "" for e in events) == "\nCalling. "


R1_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.split('</think>')"
                  "[-1] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                  "assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                  "<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.mark.parametrize("template, in_prompt", [(R1_TEMPLATE, True), (QWEN3_TEMPLATE, False)])
def test_over_http(llama_dir, tmp_path, template, in_prompt):
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    (model / "chat_template.jinja").write_text(template)
    offline = LLM(str(model), **ENGINE)
    messages = [{"role": "user", "content": "2 + 2?"}]
    prompt = offline.engine.tokenizer.apply_chat_template(messages)
    want = offline.generate([offline.engine.tokenizer.encode(prompt, add_special_tokens=False)],
                            SamplingParams(max_tokens=12, temperature=0))[0].text
    with local(str(model)) as (backend, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        done = client.chat.completions.create(model=backend.model_name, messages=messages,
                                              max_tokens=12, temperature=0)
        message = done.choices[0].message.to_dict()
        if in_prompt:  # the random model never closes the block: all of it is thinking
            assert message.get("reasoning") == want and message["content"] is None
        else:  # the output opens no block: all of it is the answer
            assert message["content"] == want and "reasoning" not in message
        stream = client.chat.completions.create(model=backend.model_name, messages=messages,
                                                max_tokens=12, temperature=0, stream=True)
        deltas = [e.choices[0].delta.to_dict() for e in stream if e.choices]
        key = "reasoning" if in_prompt else "content"
        assert "".join(d.get(key) or "" for d in deltas) == want


@pytest.mark.parametrize("template, kwargs, think, tags", [
    (R1_TEMPLATE, {}, "open", True),  # the prompt opened the block
    (QWEN3_TEMPLATE, {}, "optional", True),  # the model may open one
    (QWEN3_TEMPLATE, {"enable_thinking": False}, None, True),  # the prompt closed an empty one
    (R1_TEMPLATE, {}, None, False),  # tags spelled in several tokens: the grammar holds all
])
def test_a_structured_output_holds_the_answer_after_the_thinking(llama_dir, tmp_path, template,
                                                                 kwargs, think, tags):
    """With a reasoning model the grammar starts after the think block (as vLLM starts it),
    and the thinking is split out as without one, where the tags are tokens of their own."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from pd_runtime.entrypoints.openai.request_parsing.protocol import prepare_chat

    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    (model / "chat_template.jinja").write_text(template)
    if tags:  # as Qwen3's and DeepSeek-R1's tokenizers have them
        hf = HFTokenizer.from_file(str(model / "tokenizer.json"))
        hf.add_tokens([AddedToken(t, special=False, normalized=False)
                       for t in ("<think>", "</think>")])
        hf.save(str(model / "tokenizer.json"))
    tokenizer = Tokenizer(str(model))
    body = {"messages": [{"role": "user", "content": "2 + 2?"}], "guided_choice": ["4", "5"],
            "chat_template_kwargs": kwargs}
    prepared = prepare_chat(body, tokenizer, "m", 512)
    spec = prepared.choices[0].params.structured_outputs
    assert spec.get("think") == think and spec["choice"] == ["4", "5"]
    assert prepared.reasoning == ((think == "open") if tags else None)
    body["structured_outputs"] = {"choice": ["4"], "think": "open"}
    del body["guided_choice"]
    with pytest.raises(InvalidRequest) as refused:  # the router's own field
        prepare_chat(body, tokenizer, "m", 512)
    assert refused.value.param == "structured_outputs"
