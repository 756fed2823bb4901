"""gpt-oss's harmony output split into thinking and answer (pd_runtime/parsers/harmony.py): the
split itself, chat's stream of deltas against the whole answer and the Responses API's items
through the router's own builders, and over HTTP with a model whose template writes harmony's
channels and whose tokenizer has its markers as special tokens."""

from __future__ import annotations

import shutil

import openai
import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.parsers.harmony import content_start, split
from pd_runtime.tokenizer import Tokenizer
from tests.router_support.serving import ENGINE, local
from tests.test_reasoning import _built
from tests.test_responses_events import _accumulated, _run, _shape

THINK = "<|channel|>analysis<|message|>2 and 2 make 4.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is 4."


PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"


@pytest.mark.parametrize("text, reasoning, content, start", [
    (THINK + ANSWER, "2 and 2 make 4.", "It is 4.", len(THINK + ANSWER) - len("It is 4.")),
    (THINK, "2 and 2 make 4.", "", None),  # cut off while thinking
    ("<|channel|>analysis<|message|>2 and", "2 and", "", None),
    ("<|channel|>analy", "", "", None),  # a header not yet complete
    # a preamble (commentary to no one) is thinking; two messages of it, a newline between
    (THINK + PREAMBLE + ANSWER, "2 and 2 make 4.\nChecking.", "It is 4.",
     len(THINK + PREAMBLE + ANSWER) - len("It is 4.")),
    ("<|channel|>final<|message|>Just this.", "", "Just this.", len("<|channel|>final<|message|>")),
    ("Plain text, no channels.", None, "Plain text, no channels.", 0),
])
def test_split(text, reasoning, content, start):
    assert split(text) == (reasoning, content)
    assert content_start(text) == start


def test_a_call_or_a_message_to_another_recipient_is_neither_thinking_nor_answer():
    """(The tool-call reader reads the calls: below.)"""
    call = ("<|start|>assistant<|channel|>commentary to=functions.get_time "
            "<|constrain|>json<|message|>{\"zone\": \"UTC\"}")
    assert split(THINK + call) == ("2 and 2 make 4.", "")
    assert content_start(THINK + call) is None
    browse = "<|start|>assistant<|channel|>analysis to=browser.search<|message|>{}<|end|>"
    assert split(THINK + browse + ANSWER) == ("2 and 2 make 4.", "It is 4.")


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return Tokenizer(llama_dir)


@pytest.mark.parametrize("pieces", [1, 4, 9])
def test_chat_deltas_add_up_to_the_answer(tokenizer, pieces):
    events, final = _built(tokenizer, THINK + ANSWER, "harmony", pieces=pieces)
    assert final["message"] == {"role": "assistant", "reasoning": "2 and 2 make 4.",
                                "content": "It is 4."}
    assert "".join(e["delta"].get("reasoning", "") for e in events) == "2 and 2 make 4."
    assert "".join(e["delta"].get("content") or "" for e in events) == "It is 4."
    assert not any("<|" in (e["delta"].get("content") or "") + e["delta"].get("reasoning", "")
                   for e in events)


@pytest.mark.parametrize("pieces", [1, 5])
def test_responses_give_a_reasoning_item_and_the_message(tokenizer, pieces):
    events, body = _run(tokenizer, THINK + ANSWER, pieces, reasoning="harmony")
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]
    reasoning, message = body["output"]
    assert reasoning["content"][0]["text"] == "2 and 2 make 4."
    assert message["content"][0]["text"] == "It is 4."
    final = _accumulated(events)._completed_response  # what the official client builds
    assert _shape(final.output) == _shape(body["output"])


# A harmony-writing template, as gpt-oss's renders a conversation (its system and developer
# messages left out), with gpt-oss's markers among the tokenizer's special tokens.
HARMONY_TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}{% if m.thinking %}"
                    "<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>"
                    "{% endif %}<|start|>assistant<|channel|>final{% else %}<|start|>"
                    "{{ m.role }}{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
           "<|call|>")


@pytest.fixture(scope="module")
def harmony_model(model_factory, tmp_path_factory):
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    model = tmp_path_factory.mktemp("harmony") / "model"
    shutil.copytree(model_factory("llama", vocab_size=528), model)  # room for the markers
    (model / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    hf = HFTokenizer.from_file(str(model / "tokenizer.json"))
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MARKERS])
    hf.save(str(model / "tokenizer.json"))
    return model


def test_over_http(harmony_model):
    """The request keeps the markers in its text (special tokens); the random model writes no
    channel, so its whole output is the answer, as it decodes with them kept; a required tool
    choice is refused naming its field."""
    offline = LLM(str(harmony_model), **ENGINE)
    assert offline.engine.tokenizer.reasoning_format == "harmony"
    messages = [{"role": "user", "content": "2 + 2?"}]
    prompt = offline.engine.tokenizer.apply_chat_template(messages)
    assert prompt.endswith("<|start|>assistant")
    ids = offline.engine.tokenizer.encode(prompt, add_special_tokens=False)
    want = offline.generate([ids], SamplingParams(max_tokens=12, temperature=0,
                                                  skip_special_tokens=False))[0].text
    with local(str(harmony_model)) as (backend, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        done = client.chat.completions.create(model=backend.model_name, messages=messages,
                                              max_tokens=12, temperature=0)
        message = done.choices[0].message.to_dict()
        assert message["content"] == want and "reasoning" not in message
        tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {}}}}]
        with_tools = client.chat.completions.create(model=backend.model_name, messages=messages,
                                                    max_tokens=12, temperature=0, tools=tools)
        assert with_tools.choices[0].message.content == want  # no call: the answer
        assert not with_tools.choices[0].message.tool_calls
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=backend.model_name, messages=messages,
                                           max_tokens=4, tools=tools, tool_choice="required")
        assert refused.value.body["param"] == "tool_choice"
        assert "harmony" in refused.value.body["message"]
        # A structured output: the thinking is free until the final channel's header, which
        # this random model never writes: its output is the free one above.
        held = client.chat.completions.create(model=backend.model_name, messages=messages,
                                              max_tokens=12, temperature=0,
                                              response_format={"type": "json_object"})
        assert held.choices[0].message.content == want


def test_a_harmony_request_keeps_the_markers_in_its_text(harmony_model):
    from pd_runtime.entrypoints.openai.request_parsing.protocol import prepare_chat

    tokenizer = Tokenizer(str(harmony_model))
    prepared = prepare_chat({"messages": [{"role": "user", "content": "hi"}]}, tokenizer, "m",
                            512)
    assert prepared.reasoning == "harmony"
    assert prepared.choices[0].params.skip_special_tokens is False
    # The markers are special tokens: a plain decode drops them, this one keeps them.
    ids = tokenizer.encode(THINK + ANSWER, add_special_tokens=False)
    assert tokenizer.decode(ids) == "analysis2 and 2 make 4.assistantfinalIt is 4."
    assert split(tokenizer.decode(ids, skip_special_tokens=False)) == ("2 and 2 make 4.",
                                                                        "It is 4.")


CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
        "<|message|>{\"zone\": \"UTC\"}")


@pytest.mark.parametrize("pieces", [1, 3, 8])
def test_a_call_to_a_function_is_a_tool_call(tokenizer, pieces):
    """Thinking, a preamble, then a call (the <|call|> stop token ends it, its text left out):
    the reasoning, no content, the call with its arguments as written, streamed or whole."""
    from pd_runtime.entrypoints.openai.request_parsing.tools import ToolPlan

    text = THINK + PREAMBLE + CALL
    plan = ToolPlan("auto", parser="harmony", names=("get_time",))
    events, final = _built(tokenizer, text, "harmony", tools=plan, pieces=pieces)
    message = final["message"]
    assert final["finish_reason"] == "tool_calls"
    assert message["reasoning"] == "2 and 2 make 4.\nChecking." and not message["content"]
    [call] = message["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == \
        ("get_time", '{"zone": "UTC"}')
    streamed = [c for e in events for c in e["delta"].get("tool_calls") or []]
    assert [c["function"]["name"] for c in streamed if "id" in c] == ["get_time"]
    assert "".join(c["function"]["arguments"] for c in streamed) == '{"zone": "UTC"}'
    assert not "".join(e["delta"].get("content") or "" for e in events)
    # An answer, not a call: content as without tools.
    events, final = _built(tokenizer, THINK + ANSWER, "harmony", tools=plan, pieces=pieces)
    assert final["message"]["content"] == "It is 4." and "tool_calls" not in final["message"]
    assert final["finish_reason"] == "stop"


def test_responses_give_the_call_as_a_function_call_item(tokenizer):
    from pd_runtime.entrypoints.openai.request_parsing.tools import ToolPlan

    plan = ToolPlan("auto", parser="harmony", names=("get_time",))
    events, body = _run(tokenizer, THINK + CALL, 4, reasoning="harmony", tools=plan)
    assert [item["type"] for item in body["output"]] == ["reasoning", "function_call"]
    call = body["output"][1]
    assert (call["name"], call["arguments"]) == ("get_time", '{"zone": "UTC"}')
    final = _accumulated(events)._completed_response
    assert _shape(final.output) == _shape(body["output"])


def test_the_template_names_the_format(harmony_model):
    tokenizer = Tokenizer(str(harmony_model))
    assert (tokenizer.reasoning_format, tokenizer.tool_call_format) == ("harmony", "harmony")


def test_thinking_sent_back_reaches_the_template_as_gpt_oss_reads_it(harmony_model):
    """An earlier answer's `reasoning` (what this server returned) is the message's
    `thinking` for a harmony template, as gpt-oss's reads it."""
    from pd_runtime.entrypoints.openai.request_parsing.protocol import prepare_chat

    tokenizer = Tokenizer(str(harmony_model))
    messages = [{"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "It is 4.", "reasoning": "2 and 2 make 4."},
                {"role": "user", "content": "And 3 + 3?"}]
    prepared = prepare_chat({"messages": messages}, tokenizer, "m", 512)
    text = tokenizer.decode(prepared.prompts[0], skip_special_tokens=False)
    assert "<|start|>assistant<|channel|>analysis<|message|>2 and 2 make 4.<|end|>" \
        "<|start|>assistant<|channel|>final<|message|>It is 4.<|end|>" in text


@pytest.mark.parametrize("pieces", [1, 4])
def test_a_first_message_with_its_recipient_before_the_channel_is_a_call(tokenizer, pieces):
    """The recipient may come in the role part of the header (gpt-oss's template writes calls
    so): the output then starts with it, right after the prompt's <|start|>assistant."""
    from pd_runtime.entrypoints.openai.request_parsing.tools import ToolPlan

    text = ' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}'
    assert split(text) == ("", "")
    plan = ToolPlan("auto", parser="harmony", names=("get_time",))
    events, final = _built(tokenizer, text, "harmony", tools=plan, pieces=pieces)
    [call] = final["message"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == \
        ("get_time", '{"zone": "UTC"}')
    assert not final["message"]["content"] and final["finish_reason"] == "tool_calls"
    assert not "".join(e["delta"].get("content") or "" for e in events)


def test_an_answer_and_a_call_in_one_output_each_keep_their_own(tokenizer):
    """Past a stop token (ignore_eos, or stop ids cleared): an answer, then a call, or a call
    ended by <|end|> and then an answer; neither runs into the other."""
    from pd_runtime.entrypoints.openai.request_parsing.tools import ToolPlan

    plan = ToolPlan("auto", parser="harmony", names=("get_time",))
    for text in (THINK + ANSWER + "<|end|>" + CALL, THINK + CALL + "<|end|>" + ANSWER):
        events, final = _built(tokenizer, text, "harmony", tools=plan, pieces=3)
        message = final["message"]
        assert message["content"] == "It is 4."
        assert [c["function"]["arguments"] for c in message["tool_calls"]] == \
            ['{"zone": "UTC"}']
        assert "".join(e["delta"].get("content") or "" for e in events) == "It is 4."


def test_reasoning_tokens_count_only_thinking(harmony_model):
    """Responses' output_tokens_details.reasoning_tokens: the tokens through the thinking's
    end; none for an output that only answers (its header is no thinking)."""
    tokenizer = Tokenizer(str(harmony_model))
    for text, thinking in ((THINK + ANSWER, True), ("<|channel|>final<|message|>It is 4.", False)):
        ids = tokenizer.encode(text, add_special_tokens=False)
        prepared_events, body = _run_ids(tokenizer, text, ids)
        used = body["usage"]["output_tokens_details"]["reasoning_tokens"]
        if thinking:
            upto = tokenizer.encode(THINK + "<|start|>assistant<|channel|>final<|message|>",
                                    add_special_tokens=False)
            assert used == len(upto)  # (the answer's header with the thinking)
        else:
            assert used == 0


def _run_ids(tokenizer, text, ids):
    """A Responses builder fed `text` with its real token ids, in one chunk."""
    from pd_runtime.api import SamplingParams, StreamChunk
    from pd_runtime.entrypoints.openai.responses.request import chat_body
    from pd_runtime.entrypoints.openai.responses.events import ResponsesBuilder
    from pd_runtime.entrypoints.openai.request_parsing.schema import ChoiceSpec, PreparedRequest

    prepared = PreparedRequest("chat", "m", [[1]], [ChoiceSpec(0, 0, SamplingParams(
        max_tokens=100, skip_special_tokens=False))], False, False, 0, None,
        reasoning="harmony")
    builder = ResponsesBuilder(prepared, "resp_x", tokenizer, chat_body({"input": "hi"})[1])
    builder.add(0, StreamChunk(text=text, token_ids=ids, finished=True, finish_reason="stop"))
    return None, builder.final_body()


@pytest.mark.parametrize("header", ["<|channel|>final<|message|>",
                                    "<|channel|>final <|constrain|>json<|message|>"])
def test_a_grammar_holds_only_the_final_channel(harmony_model, header):
    """A structured output on a harmony model (the router's `think: harmony`): every token is
    free until the final channel's header (<|channel|>final, maybe a constraint, then
    <|message|>), then the grammar holds the answer, then only EOS. A final channel's start
    cut short by another message's start is no header."""
    import functools
    from types import SimpleNamespace

    from pd_runtime.engine.sampling.grammar import GrammarMasks
    from pd_runtime.entrypoints.openai.request_parsing.protocol import prepare_chat
    from tests.test_structured_outputs import allowed_tokens

    tokenizer = Tokenizer(str(harmony_model))
    prepared = prepare_chat({"messages": [{"role": "user", "content": "2 + 2?"}],
                             "guided_choice": ["4", "5"]}, tokenizer, "m", 512)
    spec = prepared.choices[0].params.structured_outputs
    assert spec["think"] == "harmony" and prepared.reasoning == "harmony"
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    width = 528
    masks = GrammarMasks(tokenizer, width)
    request = SimpleNamespace(grammar=masks.start(SamplingParams(structured_outputs=spec)),
                              output_token_ids=[], request_id="r")

    def allowed() -> set[int]:
        return allowed_tokens(masks, request, width)

    thinking = encode(THINK + "<|start|>assistant<|channel|>final<|end|><|start|>assistant"
                      "<|channel|>analysis<|message|>again<|end|><|start|>assistant")
    for token in thinking + encode(header):
        assert allowed() == set(range(width))  # free through the header
        request.output_token_ids.append(token)
    answer = allowed()
    assert encode("4")[0] in answer and encode("2")[0] not in answer and len(answer) < 10
    request.output_token_ids += encode("4")
    assert allowed() == set(tokenizer.eos_token_ids)
