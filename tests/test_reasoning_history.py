"""Earlier thinking sent back (pd_runtime/entrypoints/openai/request_parsing/chat_prompt.py,
pd_runtime/entrypoints/openai/responses/request.py): an assistant message's `reasoning` or
`reasoning_content` reaches the chat template (Qwen3's writes it back into the turns of a tool
loop), a Responses reasoning item goes with the assistant turn after it, and a stored response's
conversation keeps its thinking, so `previous_response_id` renders what a chat client sending the
thinking back gets."""

from __future__ import annotations

import shutil

import openai
import pytest

from pd_runtime.entrypoints.openai.request_parsing.protocol import prepare_chat
from pd_runtime.entrypoints.openai.responses.request import chat_body
from pd_runtime.entrypoints.openai.request_parsing.schema import InvalidRequest
from pd_runtime.tokenizer import Tokenizer
from tests.router_support.serving import local

# Writes an assistant turn's thinking back, as Qwen3's template does after the last user
# message; the generation prompt opens a block (DeepSeek-R1's way), so the untrained test
# model's whole output is thinking.
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}<think>"
            "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "add", "arguments": "{\"a\": 2}"}}


@pytest.fixture
def model_dir(llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    return str(model)


def _text(tokenizer, messages) -> str:
    return tokenizer.decode(prepare_chat({"messages": messages}, tokenizer, "m", 512).prompts[0])


def test_either_name_reaches_the_template(model_dir):
    tokenizer = Tokenizer(model_dir)
    turns = [{"role": "user", "content": "2 + 2?"}, None, {"role": "user", "content": "and 3?"}]
    texts = []
    for name in ("reasoning", "reasoning_content"):
        turns[1] = {"role": "assistant", "content": "4", name: "add them"}
        texts.append(_text(tokenizer, turns))
    assert texts[0] == texts[1] and "<think>add them</think>4" in texts[0]
    turns[1] = {"role": "assistant", "content": "4"}
    assert "<think>add them" not in _text(tokenizer, turns)
    # Only an assistant's: a user's field of that name is not thinking.
    assert "<think>x" not in _text(tokenizer, [{"role": "user", "content": "hi",
                                                "reasoning": "x"}])
    for bad in ({"reasoning": 3}, {"reasoning": "a", "reasoning_content": "b"}):
        turns[1] = {"role": "assistant", "content": "4", **bad}
        with pytest.raises(InvalidRequest) as refused:
            _text(tokenizer, turns)
        assert refused.value.param == "messages[1].reasoning"


def test_a_reasoning_item_goes_with_the_assistant_turn_after_it():
    think = {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "call add"}]}
    call = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "4"}
    chat, _ = chat_body({"input": [{"role": "user", "content": "2 + 2?"},
                                   think, call, result, dict(think, content=[
                                       {"type": "reasoning_text", "text": "done"}]),
                                   {"role": "assistant", "content": "4"}]})
    roles = [(m["role"], m.get("reasoning")) for m in chat["messages"]]
    assert roles == [("user", None), ("assistant", "call add"), ("tool", None),
                     ("assistant", "done")]
    assert chat["messages"][1]["tool_calls"][0]["function"]["name"] == "add"
    # A reasoning item with nothing after it but a user turn is no one's.
    chat, _ = chat_body({"input": [think, {"role": "user", "content": "hi"}]})
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequest) as refused:
        chat_body({"input": [dict(think, content="text"), {"role": "user", "content": "hi"}]})
    assert refused.value.param == "input[0].content"


def test_a_stored_response_continues_with_its_thinking(model_dir):
    """The second turn's prompt, by previous_response_id, is chat's with the first answer's
    thinking sent back: the same output tokens."""
    sampling = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
    with local(model_dir) as (backend, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        name = backend.model_name
        first = client.responses.create(model=name, input="2 + 2?", max_output_tokens=6,
                                        **sampling)
        [item] = first.output  # never closing its block, the test model only thinks
        assert item.type == "reasoning" and item.content[0].text
        second = client.responses.create(model=name, input="and 3?", max_output_tokens=6,
                                         previous_response_id=first.id, **sampling)
        chat = client.chat.completions.create(model=name, max_tokens=6, messages=[
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": None, "reasoning": item.content[0].text},
            {"role": "user", "content": "and 3?"}], **sampling)
        assert second.output[0].content[0].text == chat.choices[0].message.reasoning
        assert second.usage.input_tokens == chat.usage.prompt_tokens
        without = client.chat.completions.create(model=name, max_tokens=6, messages=[
            {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "and 3?"}], **sampling)
        assert without.usage.prompt_tokens < chat.usage.prompt_tokens  # it was written back
