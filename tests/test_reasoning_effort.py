"""OpenAI's `reasoning_effort` (chat) and `reasoning.effort` / `.summary` (Responses) on open
models (pd_runtime/entrypoints/openai/request_parsing/chat_prompt.py): the template's `reasoning_effort` variable,
its `enable_thinking` switch (off for "none", on for a level), and a 400 naming the field where the
model cannot honour it (no thinking at all, or no switch to turn it off)."""

from __future__ import annotations

import shutil

import openai
import pytest

from pd_runtime.entrypoints.openai.request_parsing.protocol import prepare_chat, prepare_completion
from pd_runtime.entrypoints.openai.request_parsing.schema import InvalidRequest
from pd_runtime.tokenizer import Tokenizer
from tests.router_support.serving import local
from tests.test_reasoning import QWEN3_TEMPLATE, R1_TEMPLATE

EFFORT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>Reasoning: "
                   "{{ reasoning_effort | default('medium') }}\n{% endif %}")
# Thinking is opt-in (off unless asked), and the prompt opens the block when it is on.
OPT_IN_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>"
                   "{% if enable_thinking | default(false) %}<think>\n{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "2 + 2?"}]


def _tokenizer(llama_dir, tmp_path, template=None) -> Tokenizer:
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    if template is not None:
        (model / "chat_template.jinja").write_text(template)
    return Tokenizer(str(model))


def _prompt(tokenizer, **fields) -> list[int]:
    return prepare_chat({"messages": MESSAGES, **fields}, tokenizer, "m", 512).prompts[0]


def _refused(tokenizer, **fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        _prompt(tokenizer, **fields)
    return refused.value


def test_none_turns_qwen3_thinking_off_and_a_level_changes_nothing(llama_dir, tmp_path):
    tokenizer = _tokenizer(llama_dir, tmp_path, QWEN3_TEMPLATE)
    off = _prompt(tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert _prompt(tokenizer, reasoning_effort="none") == off != _prompt(tokenizer)
    for effort in ("minimal", "low", "medium", "high", "xhigh", "max"):
        assert _prompt(tokenizer, reasoning_effort=effort) == _prompt(tokenizer)
    clash = _refused(tokenizer, reasoning_effort="none",
                     chat_template_kwargs={"enable_thinking": True})
    assert clash.param == "reasoning_effort" and "enable_thinking True" in clash.message
    assert _refused(tokenizer, reasoning_effort="extreme").param == "reasoning_effort"


def test_a_level_turns_opt_in_thinking_on(llama_dir, tmp_path):
    """A template whose thinking is off unless asked: a level asks (the prompt opens the
    block, so the output is read as thinking first), "none" leaves it off."""
    tokenizer = _tokenizer(llama_dir, tmp_path, OPT_IN_TEMPLATE)

    def prepared(**fields):
        return prepare_chat({"messages": MESSAGES, **fields}, tokenizer, "m", 512)

    on = _prompt(tokenizer, chat_template_kwargs={"enable_thinking": True})
    assert tokenizer.decode(on).endswith("<think>\n") and on != _prompt(tokenizer)
    for effort in ("low", "max"):
        assert prepared(reasoning_effort=effort).prompts[0] == on
        assert prepared(reasoning_effort=effort).reasoning is True
    assert prepared(reasoning_effort="none").prompts[0] == _prompt(tokenizer)
    assert prepared(reasoning_effort="none").reasoning is False
    clash = _refused(tokenizer, reasoning_effort="high",
                     chat_template_kwargs={"enable_thinking": False})
    assert clash.param == "reasoning_effort" and "enable_thinking False" in clash.message


def test_a_template_that_reads_the_effort_gets_it(llama_dir, tmp_path):
    tokenizer = _tokenizer(llama_dir, tmp_path, EFFORT_TEMPLATE)
    for effort in ("low", "high", "none"):
        text = tokenizer.decode(_prompt(tokenizer, reasoning_effort=effort))
        assert text.endswith(f"Reasoning: {effort}\n")
    clash = _refused(tokenizer, reasoning_effort="low",
                     chat_template_kwargs={"reasoning_effort": "high"})
    assert clash.param == "reasoning_effort"


def test_a_model_that_cannot_honour_it_refuses_it(llama_dir, tmp_path):
    plain = Tokenizer(llama_dir)  # the test model's template has no thinking
    refused = _refused(plain, reasoning_effort="low")
    assert refused.param == "reasoning_effort" and refused.code == "unsupported_parameter"
    plain.reasoning_format = "think"  # the operator says it thinks (router.reasoning_parser)
    assert _prompt(plain, reasoning_effort="low") == _prompt(plain)
    plain.reasoning_format = None
    always = _tokenizer(llama_dir, tmp_path, R1_TEMPLATE)  # thinks, with no switch
    assert _prompt(always, reasoning_effort="high") == _prompt(always)
    refused = _refused(always, reasoning_effort="none")
    assert refused.param == "reasoning_effort" and "turn its thinking off" in refused.message
    with pytest.raises(InvalidRequest) as completion:  # a chat field only
        prepare_completion({"prompt": "hi", "reasoning_effort": "low"}, plain, "m", 512)
    assert completion.value.param == "reasoning_effort"


def test_the_official_client_sends_it_on_both_endpoints(llama_dir, tmp_path):
    """Chat's reasoning_effort and Responses' reasoning (with a summary asked for, which is
    echoed, none being made) over HTTP: "none" answers as enable_thinking false does."""
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    (model / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    sampling = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
    with local(str(model)) as (backend, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        name = backend.model_name
        off = client.chat.completions.create(
            model=name, messages=MESSAGES, max_tokens=8, temperature=0.0,
            extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
        chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=8,
                                              reasoning_effort="none", **sampling)
        assert chat.choices[0].message.content == off.choices[0].message.content
        response = client.responses.create(model=name, input=MESSAGES[0]["content"],
                                           max_output_tokens=8,
                                           reasoning={"effort": "none", "summary": "auto"},
                                           **sampling)
        assert response.output_text == off.choices[0].message.content
        assert response.reasoning.effort == "none" and response.reasoning.summary == "auto"
        for bad in ({"effort": "extreme"}, {"effort": "extreme", "previous": "resp_unknown"},
                    {"context": "all_turns"}, {"mode": "pro"}):
            # judged before any stored conversation is looked for
            previous = bad.pop("previous", None)
            with pytest.raises(openai.BadRequestError) as refused:
                client.responses.create(model=name, input="hi", reasoning=bad,
                                        previous_response_id=previous)
            assert refused.value.body["param"] == f"reasoning.{next(iter(bad))}"
        echoed = client.responses.create(model=name, input="hi", max_output_tokens=2,
                                         reasoning={"effort": "max", "context": "auto"})
        assert echoed.reasoning.effort == "max" and echoed.reasoning.context == "auto"
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=name, input="hi", reasoning={"summary": "long"})
        assert refused.value.body["param"] == "reasoning.summary"


def test_a_model_without_thinking_refuses_it_by_the_responses_name(llama_dir):
    with local(llama_dir) as (backend, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=backend.model_name, input="hi",
                                    reasoning={"effort": "low"})
        assert refused.value.body["param"] == "reasoning.effort"
        assert "reasoning.effort is not supported with this model" in \
            refused.value.body["message"]


def test_enable_thinking_beside_an_effort_must_be_a_boolean(llama_dir, tmp_path):
    """Qwen3's template tests `enable_thinking is false`: a 0 would leave it thinking under
    "none", a "false" string too; with an effort either is refused, naming the field."""
    tokenizer = _tokenizer(llama_dir, tmp_path, QWEN3_TEMPLATE)
    for value in (0, "false", None):
        refused = _refused(tokenizer, reasoning_effort="none",
                           chat_template_kwargs={"enable_thinking": value})
        assert refused.param == "chat_template_kwargs" and "true or false" in refused.message
