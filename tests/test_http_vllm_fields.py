"""vLLM's request extensions as the tools that send them use them, over HTTP with the official
`openai` client (the router over an in-process worker, as tests/test_router_http.py serves it):
min_tokens, prompt truncation, special tokens, echo with logprobs (evaluation harnesses)."""

from __future__ import annotations

import openai
import pytest

from tests.router_support.served_model import client, greedy, offline, server  # noqa: F401


def test_min_tokens_as_load_generators_send_it(server, client):
    """vLLM's min_tokens (benchmarks send it to fix output lengths): no EOS before it."""
    backend, _ = server
    eos = min(backend.tokenizer.eos_token_ids)
    extra = {"min_tokens": 6, "logit_bias": {str(eos): 100}}
    got = client.completions.create(model=backend.model_name, prompt="fixed length",
                                    max_tokens=10, temperature=0, extra_body=extra)
    assert got.usage.completion_tokens == 7 and got.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=backend.model_name, max_tokens=10,
                                          messages=[{"role": "user", "content": "x"}],
                                          extra_body=extra, temperature=0)
    assert chat.usage.completion_tokens == 7


def test_truncate_prompt_tokens_keeps_the_end(server, client, offline, llama_dir):
    """vLLM's truncate_prompt_tokens: the prompt cut as an HF tokenizer cuts it (its BOS kept),
    from the start or the end (truncation_side); -1 leaves room for max_tokens."""
    from transformers import AutoTokenizer

    backend, _ = server
    name, limit = backend.model_name, backend.max_model_len
    ids = [5 + (7 * i) % 300 for i in range(limit + 40)]
    want = offline.generate(ids[-30:], greedy(4))[0]
    got = client.completions.create(model=name, prompt=ids, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True, "truncate_prompt_tokens": 30})
    assert got.usage.prompt_tokens == 30 and got.choices[0].text == want.text
    got = client.completions.create(model=name, prompt=ids, max_tokens=4, temperature=0,
                                    extra_body={"truncate_prompt_tokens": -1})
    assert got.usage.prompt_tokens == limit - 4
    # A bound past the prompt's length is no error (as vLLM): nothing to cut.
    short = client.completions.create(model=name, prompt="hi", max_tokens=2,
                                      extra_body={"truncate_prompt_tokens": limit})
    assert short.usage.prompt_tokens == len(backend.tokenizer.encode("hi"))
    text = " ".join(f"word{i}" for i in range(limit))
    for side in ("left", "right"):
        reference = AutoTokenizer.from_pretrained(llama_dir, truncation_side=side)
        cut = reference(text, truncation=True, max_length=25)["input_ids"]
        assert cut[0] == reference.bos_token_id
        want = offline.generate(cut, greedy(3))[0]
        got = client.completions.create(model=name, prompt=text, max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True, "truncation_side": side,
                                                    "truncate_prompt_tokens": 25})
        assert got.usage.prompt_tokens == 25 and got.choices[0].text == want.text, side
    chat = client.chat.completions.create(model=name, max_tokens=2, temperature=0,
                                          messages=[{"role": "user", "content": text}],
                                          extra_body={"truncate_prompt_tokens": 25})
    assert chat.usage.prompt_tokens == 25
    for extra, param in (({}, "prompt"), ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                         ({"truncate_prompt_tokens": limit + 1}, "truncate_prompt_tokens"),
                         # Kept, it still leaves no room for max_tokens: refused as any prompt.
                         ({"truncate_prompt_tokens": limit - 1}, "prompt"),
                         ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
                         ({"spaces_between_special_tokens": False},
                          "spaces_between_special_tokens"),
                         ({"logits_processors": ["my.Processor"]}, "logits_processors")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=name, prompt=ids, max_tokens=2, extra_body=extra)
        assert caught.value.body["param"] == param, extra
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=name, max_tokens=2, extra_body={"echo": True},
                                       messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["param"] == "echo"


def test_echo_with_logprobs_scores_the_prompt(server, client, offline, llama_dir):
    """How evaluation harnesses score a text (lm-eval's local-completions loglikelihood):
    token-id prompts, echo, logprobs 1, max_tokens 1; the prompt's logprobs are transformers'."""
    import torch
    from transformers import AutoModelForCausalLM

    backend, _ = server
    ids = [[5 + (11 * i) % 300 for i in range(40)], [7, 8, 9, 10, 11]]
    got = client.completions.create(model=backend.model_name, prompt=ids, max_tokens=1,
                                    temperature=0, logprobs=1, echo=True, seed=1234)
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    for choice, prompt in zip(sorted(got.choices, key=lambda c: c.index), ids):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
        for p in range(1, len(prompt)):
            assert abs(lp.token_logprobs[p] - ref[p - 1, prompt[p]].item()) < 1e-4
            best = ref[p - 1].max().item()
            assert abs(max(lp.top_logprobs[p].values()) - best) < 1e-4
        # lm-eval's reading: the continuation's logprob and whether greedy would produce it.
        ctx = len(prompt) // 2
        total = sum(lp.token_logprobs[ctx:-1])
        assert abs(total - ref[ctx - 1:-1].gather(1, torch.tensor(prompt[ctx:])[:, None]).sum()
                   .item()) < 1e-3
        generated = offline.generate(prompt, greedy(1))[0].text
        assert choice.text == backend.tokenizer.decode(prompt, skip_special_tokens=False) \
            + generated
    one = client.completions.create(model=backend.model_name, prompt=[[5]], max_tokens=1,
                                    temperature=0, logprobs=1, echo=True).choices[0].logprobs
    assert one.token_logprobs[0] is None and len(one.token_logprobs) == 2
    # Offsets from the token strings, prompt and generated alike (as vLLM gives them).
    assert one.text_offset == [0, len(one.tokens[0])]
    streamed = list(client.completions.create(model=backend.model_name, prompt=ids[1],
                                              max_tokens=2, temperature=0, logprobs=1,
                                              echo=True, stream=True))
    # The first event carries the echoed prompt's entries, then its generated tokens' (one or
    # both, as the steps fell); the events together: the prompt and both tokens.
    first = streamed[0].choices[0].logprobs
    assert first.token_logprobs[0] is None
    assert first.token_logprobs[1:5] == got.choices[1].logprobs.token_logprobs[1:5]
    assert sum(len(e.choices[0].logprobs.token_logprobs) for e in streamed
               if e.choices[0].logprobs) == len(ids[1]) + 2


def test_add_special_tokens(server, client, offline):
    backend, _ = server
    tok = backend.tokenizer
    plain = tok.encode("no bos here", add_special_tokens=False)
    assert tok.encode("no bos here") != plain  # the tokenizer adds a BOS by default
    for extra, ids in (({}, tok.encode("no bos here")),
                       ({"add_special_tokens": False}, plain)):
        got = client.completions.create(model=backend.model_name, prompt="no bos here",
                                        max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True, **extra})
        assert got.usage.prompt_tokens == len(ids)
        assert got.choices[0].text == offline.generate(ids, greedy(3))[0].text
    messages = [{"role": "user", "content": "hi"}]
    chat = [client.chat.completions.create(model=backend.model_name, messages=messages,
                                           max_tokens=1, extra_body=extra)
            for extra in ({}, {"add_special_tokens": True})]
    assert chat[1].usage.prompt_tokens == chat[0].usage.prompt_tokens + 1


def test_tokenizer_endpoints(server):
    """vLLM's /tokenize, /detokenize and /tokenizer_info, as lm-eval's remote tokenizer uses
    them (a client with no copy of the model's files)."""
    import httpx

    backend, port = server
    base = f"http://127.0.0.1:{port}"
    tok = backend.tokenizer
    got = httpx.post(f"{base}/tokenize", json={"prompt": "hello world"}).json()
    assert got["tokens"] == tok.encode("hello world") and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == backend.max_model_len and got["token_strs"] is None
    plain = httpx.post(f"{base}/tokenize", json={"prompt": "test", "add_special_tokens": False,
                                                  "return_token_strs": True}).json()
    assert plain["tokens"] == tok.encode("test", add_special_tokens=False)
    assert "".join(plain["token_strs"]) == "test"
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{base}/tokenize", json={"model": backend.model_name,
                                                 "messages": messages}).json()
    assert chat["tokens"] == tok.encode_chat(messages)
    back = httpx.post(f"{base}/detokenize", json={"tokens": got["tokens"]}).json()
    assert back["prompt"] == tok.decode(got["tokens"], skip_special_tokens=False)
    info = httpx.get(f"{base}/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    for path, body, param in (("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": "1 2"}, "tokens")):
        response = httpx.post(base + path, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_stop_reason_as_vllm_reports_it(server, client, offline):
    """Each choice's stop_reason: the stop string it matched, the stop token it sampled, null
    for a length limit; on the streamed choice that finishes too (completions and chat)."""
    backend, _ = server
    name, prompt = backend.model_name, "The weather today"
    free = offline.generate(prompt, greedy(12))[0].outputs[0]
    word = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    token = free.token_ids[4]
    cases = [({"stop": ["\x00never", word]}, word), ({"stop_token_ids": [token]}, token),
             ({}, None)]
    for extra, want in cases:
        body = {"ignore_eos": True, **{k: v for k, v in extra.items() if k != "stop"}}
        got = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                        stop=extra.get("stop"), extra_body=body)
        assert got.choices[0].stop_reason == want, extra
        assert got.choices[0].finish_reason == ("length" if want is None else "stop")
        events = list(client.completions.create(model=name, prompt=prompt, max_tokens=12,
                                                temperature=0, stop=extra.get("stop"),
                                                extra_body=body, stream=True))
        finishing = [c for e in events for c in e.choices if c.finish_reason is not None]
        assert [c.stop_reason for c in finishing] == [want], extra
        # only on the finishing event (a busy server may send just that one, merged)
        assert all("stop_reason" not in (c.model_extra or {}) for e in events for c in e.choices
                   if c.finish_reason is None)
    messages = [{"role": "user", "content": prompt}]
    own = offline.chat(messages, greedy(12))[0].outputs[0]
    for extra, want in (({"stop_token_ids": [own.token_ids[4]]}, own.token_ids[4]), ({}, None)):
        body = {"ignore_eos": True, **extra}
        chat = client.chat.completions.create(model=name, messages=messages, max_tokens=12,
                                              temperature=0, extra_body=body)
        assert chat.choices[0].stop_reason == want, extra
        events = list(client.chat.completions.create(model=name, messages=messages, max_tokens=12,
                                                     temperature=0, extra_body=body, stream=True))
        finishing = [c for e in events for c in e.choices if c.finish_reason is not None]
        assert [c.stop_reason for c in finishing] == [want], extra
