"""Chat templates rendered as `transformers` renders them (its apply_chat_template is the
reference): the Jinja features checkpoints' templates use, template variables, a final message
left open; then the same options through the HTTP API with the official `openai` client."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from pd_runtime.chat_template import ChatTemplateError
from pd_runtime.tokenizer import Tokenizer, read_tokenizer_files
from pd_runtime import LLM, SamplingParams
from tests.router_support.serving import ENGINE, local

# Each uses something a plain sandboxed Jinja environment lacks or renders differently.
TEMPLATES = {
    # {% break %} / {% continue %} (loop controls): the system message once, empty turns skipped.
    "loop_controls": (
        "{% for m in messages %}{% if m.role == 'system' %}[sys]{{ m.content }}{% break %}"
        "{% endif %}{% endfor %}"
        "{% for m in messages %}{% if m.content == '' %}{% continue %}{% endif %}"
        "<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"),
    # tojson keeps non-ASCII and HTML characters, with indent and sort_keys as keywords.
    "tojson": (
        "{{ messages | tojson }}|{{ messages[-1] | tojson(indent=2, sort_keys=true) }}"
        "{% if add_generation_prompt %}>{% endif %}"),
    # A namespace across the loop, the generation block, bos_token, a template variable.
    "namespace_generation": (
        "{{ bos_token }}{% set ns = namespace(last_user=-1) %}"
        "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}"
        "{% endif %}{% endfor %}"
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "A:{{ m.content }}{% endgeneration %}{% else %}U{{ loop.index0 }}:{{ m.content }}"
        "{% endif %}\n{% endfor %}last user {{ ns.last_user }}"
        "{% if add_generation_prompt %}A:{% if enable_thinking is defined and "
        "not enable_thinking %}<think></think>{% endif %}{% endif %}"),
    # strftime_now with a date-only format (the day cannot turn between the two renders).
    "strftime": "{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}{% endfor %}",
    # The names transformers always passes: special tokens, and tools / documents as none.
    "special_tokens": (
        "{% if tools is not none %}TOOLS{% endif %}{% if documents is none %}[no docs]{% endif %}"
        "{{ pad_token }}|{{ eos_token }}|{% for m in messages %}{{ m.content }}{% endfor %}"),
    # A template that trims content: continuing the final message must cut at the trimmed end.
    "trimming": (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"),
}

MESSAGES = [{"role": "system", "content": "Réponds <court> & \"net\" 🙂"},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "second {\"k\": [1, 2]}"}]
OPEN_ENDED = MESSAGES[:2] + [{"role": "assistant", "content": "The answer is "}]


@pytest.fixture(scope="module")
def reference(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def ours(llama_dir, template: str) -> Tokenizer:
    return Tokenizer({**read_tokenizer_files(llama_dir), "chat_template": template})


def hf_render(reference, template: str, messages, **kwargs) -> str:
    return reference.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         **kwargs)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_templates_render_as_transformers(llama_dir, reference, name, generation_prompt):
    template = TEMPLATES[name]
    got = ours(llama_dir, template).apply_chat_template(
        MESSAGES, add_generation_prompt=generation_prompt)
    assert got == hf_render(reference, template, MESSAGES,
                            add_generation_prompt=generation_prompt)


def test_template_variables_and_continued_final_message(llama_dir, reference):
    template = TEMPLATES["namespace_generation"]
    tok = ours(llama_dir, template)
    got = tok.apply_chat_template(MESSAGES, enable_thinking=False)
    assert got.endswith("A:<think></think>")
    assert got == hf_render(reference, template, MESSAGES, add_generation_prompt=True,
                            enable_thinking=False)
    for name in ("namespace_generation", "trimming", "loop_controls"):
        template = TEMPLATES[name]
        got = ours(llama_dir, template).apply_chat_template(
            OPEN_ENDED, add_generation_prompt=False, continue_final_message=True)
        want = hf_render(reference, template, OPEN_ENDED, continue_final_message=True)
        assert got == want, name
        assert got.rstrip().endswith("The answer is")


def test_template_refusals(llama_dir):
    tok = ours(llama_dir, "{% if messages|length > 1 %}{{ raise_exception('one only') }}"
                          "{% endif %}{{ messages[0].content }}")
    with pytest.raises(ChatTemplateError, match="one only"):
        tok.apply_chat_template(MESSAGES)
    with pytest.raises(ChatTemplateError, match="both"):
        tok.apply_chat_template(OPEN_ENDED, continue_final_message=True)
    # A template that drops the final message's text cannot continue it.
    dropping = ours(llama_dir, "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        dropping.apply_chat_template(OPEN_ENDED, add_generation_prompt=False,
                                     continue_final_message=True)
    # The sandbox holds: no way from a template to Python internals.
    escape = ours(llama_dir, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        escape.apply_chat_template(MESSAGES)


# ------------------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def served(llama_dir):
    with local(llama_dir) as (backend, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0)
        yield backend, client


def _prompt_tokens(client, model, messages, **extra) -> int:
    got = client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                         temperature=0, extra_body=extra or None)
    return got.usage.prompt_tokens


def test_chat_options_over_http(served, reference):
    backend, client = served
    model = backend.model_name
    template = backend.tokenizer.chat_template

    def hf_ids(messages, **kwargs) -> int:
        return len(reference(hf_render(reference, template, messages, **kwargs),
                             add_special_tokens=False)["input_ids"])

    assert _prompt_tokens(client, model, MESSAGES) == \
        hf_ids(MESSAGES, add_generation_prompt=True)
    assert _prompt_tokens(client, model, MESSAGES, add_generation_prompt=False) == \
        hf_ids(MESSAGES, add_generation_prompt=False)
    assert _prompt_tokens(client, model, OPEN_ENDED, add_generation_prompt=False,
                          continue_final_message=True) == \
        hf_ids(OPEN_ENDED, continue_final_message=True)
    # Text parts of one message join with newlines (as vLLM joins them).
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"},
                                          {"type": "text", "text": "two"}]}]
    assert _prompt_tokens(client, model, parts) == \
        hf_ids([{"role": "user", "content": "one\ntwo"}], add_generation_prompt=True)

    for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                         ({"chat_template": "{{ 1 }}"}, "chat_template")):
        with pytest.raises(openai.BadRequestError) as err:
            _prompt_tokens(client, model, OPEN_ENDED, **extra)
        assert err.value.body["param"] == param, extra


def test_named_templates_and_template_files(llama_dir, tmp_path):
    """tokenizer_config.json may hold a list of named templates (the "default" one is used, as
    transformers picks it); processors keep the template in chat_template.json."""
    import json
    import shutil

    named = tmp_path / "named"
    shutil.copytree(llama_dir, named)
    config_file = named / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "TOOLS{{ messages[0].content }}"},
                               {"name": "default", "template": TEMPLATES["loop_controls"]}]
    config_file.write_text(json.dumps(config))
    (named / "chat_template.jinja").unlink(missing_ok=True)
    got = Tokenizer(named).apply_chat_template(MESSAGES)
    assert got.startswith("[sys]")
    assert got == AutoTokenizer.from_pretrained(named).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)

    in_json = tmp_path / "json"
    shutil.copytree(named, in_json)
    config.pop("chat_template")
    (in_json / "tokenizer_config.json").write_text(json.dumps(config))
    (in_json / "chat_template.json").write_text(json.dumps(
        {"chat_template": TEMPLATES["trimming"]}))
    assert Tokenizer(in_json).apply_chat_template(MESSAGES[:2]) == \
        "<|system|>Réponds <court> & \"net\" 🙂<|end|><|user|>first<|end|><|assistant|>"


def test_offline_chat_answers_as_the_chat_api(served, llama_dir):
    backend, client = served
    llm = LLM(llama_dir, **ENGINE)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for conversations, options in (([MESSAGES], {}),
                                   ([OPEN_ENDED, MESSAGES], {"add_generation_prompt": False,
                                                             "continue_final_message": True})):
        offline = llm.chat(conversations if len(conversations) > 1 else conversations[0],
                           params, **options)
        assert len(offline) == len(conversations)
        for messages, got in zip(conversations, offline):
            api = client.chat.completions.create(
                model=backend.model_name, messages=messages, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True, **options})
            assert got.text == api.choices[0].message.content
            assert len(got.prompt_token_ids) == api.usage.prompt_tokens


def test_offline_chat_takes_a_template_of_its_own(llama_dir):
    """LLM.chat(chat_template=...) renders with that template for the call (as vLLM's LLM.chat
    takes one), and the model's stays for the next."""
    llm = LLM(llama_dir, **ENGINE)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    own = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    got = llm.chat(MESSAGES[:2], params, chat_template=own)[0]
    rendered = "".join(f"[{m['role']}] {m['content']}\n" for m in MESSAGES[:2]) + "[assistant] "
    assert got.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    plain = llm.chat(MESSAGES[:2], params)[0]
    assert plain.prompt_token_ids == llm.tokenizer.encode_chat(MESSAGES[:2])
