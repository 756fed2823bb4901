"""A checkpoint's generation_config.json sampling fields as the defaults of requests that leave
them out (as vLLM applies them), offline and through the router, and `router.sampling_defaults:
openai` to turn them off."""

from __future__ import annotations

import json
import logging
import shutil

import openai
import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.config import RouterConfig
from pd_runtime.sampling_defaults import read_sampling_defaults
from pd_runtime.tokenizer import Tokenizer
from tests.router_support.serving import APPS, ENGINE, local

GENERATION_CONFIG = {"bos_token_id": 0, "eos_token_id": [1, 3], "do_sample": False,
                     "temperature": 0.7, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.1,
                     "max_new_tokens": 6}
DEFAULTS = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.1,
            "max_tokens": 6}


@pytest.fixture(scope="module")
def model_dir(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("with-defaults") / "model"
    shutil.copytree(llama_dir, path)
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return str(path)


def test_read_from_generation_config(model_dir, tmp_path, caplog):
    assert read_sampling_defaults(model_dir) == DEFAULTS
    assert read_sampling_defaults(tmp_path) == {}  # no file
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.0, "min_p": 0.05, "top_k": 20.0}))
    with caplog.at_level(logging.WARNING):
        assert read_sampling_defaults(tmp_path) == {"temperature": 0.6, "min_p": 0.05,
                                                    "top_k": 20}
    assert "top_p=0.0 left out" in caplog.text
    # A file that is not JSON costs its defaults and EOS ids, with a warning, not the model.
    shutil.copytree(model_dir, tmp_path / "broken")
    (tmp_path / "broken" / "generation_config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert read_sampling_defaults(tmp_path / "broken") == {}
        assert Tokenizer(tmp_path / "broken").eos_token_ids
    assert "not valid JSON" in caplog.text


def test_offline_generate_without_params_uses_them(model_dir):
    llm = LLM(model_dir, **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS)
    prompt = "The prefill worker"
    # Unseeded sampling differs run to run: compare with the seed the defaults leave unset.
    got = llm.generate(prompt, SamplingParams(**DEFAULTS, seed=3, ignore_eos=True))[0]
    plain = llm.generate(prompt, SamplingParams(seed=3, max_tokens=6, ignore_eos=True))[0]
    assert len(got.token_ids) == 6 and got.token_ids != plain.token_ids
    assert len(llm.generate(prompt)[0].token_ids) <= 6  # max_new_tokens is the default length


def _complete(client, model, padding: int = 0, **kwargs):
    # An unknown field is ignored: padding past 8 KiB sends the body through the parser process.
    extra = {"ignore_eos": True, **({"padding": "x" * padding} if padding else {})}
    return client.completions.create(model=model, prompt="The prefill worker", seed=3,
                                     extra_body=extra, **kwargs).choices[0]


def test_router_applies_them_to_fields_left_out(model_dir):
    llm = LLM(model_dir, **ENGINE)
    prompt = "The prefill worker"

    def offline(**params):
        return llm.generate(prompt, SamplingParams(seed=3, ignore_eos=True, **params))[0].text

    with local(model_dir) as (backend, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0)
        model = backend.model_name
        assert backend.active_config()["sampling_defaults"] == DEFAULTS
        assert _complete(client, model).text == offline(**DEFAULTS)
        intake = APPS[port].state.intake
        assert _complete(client, model, padding=9000).text == offline(**DEFAULTS)
        assert intake.prepared_in_child == 1
        # A field the request names wins; the others keep the model's.
        assert _complete(client, model, temperature=1.0, max_tokens=9).text == \
            offline(**{**DEFAULTS, "temperature": 1.0, "max_tokens": 9})
        assert _complete(client, model, temperature=0).text == \
            offline(**{**DEFAULTS, "temperature": 0.0})
        chat = client.chat.completions.create(model=model, seed=3,
                                              messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 6  # max_new_tokens, not the rest of the context

    with local(model_dir, RouterConfig(routing={"mode": "always_colocated"},
                                       sampling_defaults="openai")) as (backend, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0)
        assert backend.active_config()["sampling_defaults"] == {}
        assert _complete(client, backend.model_name).text == offline(max_tokens=16)
