"""vLLM's token-level extensions as RL and evaluation tools send them, over HTTP with the
official `openai` client (the router over an in-process worker): return_token_ids,
return_tokens_as_token_ids, prompt_logprobs, allowed_token_ids, bad_words, cache_salt."""

from __future__ import annotations

import openai
import pytest
import torch

from pd_runtime import SamplingParams
from tests.router_support.served_model import client, greedy, offline, server  # noqa: F401

MESSAGES = [{"role": "user", "content": "Tell me about tokens"}]


def test_return_token_ids(server, client, offline):
    """The prompt's ids and each choice's generated ids, whole and streamed (each event its
    new ids, the first the prompt's), as an RL trainer reads them instead of re-tokenizing."""
    backend, _ = server
    tok, name = backend.tokenizer, backend.model_name
    prompts = ["The quick brown fox", "Once upon"]
    extra = {"return_token_ids": True, "ignore_eos": True}
    got = client.completions.create(model=name, prompt=prompts, max_tokens=6, temperature=0,
                                    extra_body=extra)
    for choice in got.choices:
        ids = tok.encode(prompts[choice.index])
        want = offline.generate(ids, greedy(6))[0]
        assert choice.prompt_token_ids == ids and choice.token_ids == want.token_ids
        assert choice.text == want.text
    events = list(client.completions.create(model=name, prompt=prompts[0], max_tokens=6,
                                            temperature=0, stream=True, extra_body=extra))
    assert events[0].choices[0].prompt_token_ids == tok.encode(prompts[0])
    assert all(getattr(e.choices[0], "prompt_token_ids", None) is None for e in events[1:])
    streamed = [t for e in events for t in e.choices[0].token_ids]
    assert streamed == got.choices[0].token_ids

    chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=5,
                                          temperature=0, n=2, extra_body=extra)
    prompt = tok.encode_chat(MESSAGES)
    want = offline.generate(prompt, greedy(5))[0]
    assert chat.prompt_token_ids == prompt and chat.usage.prompt_tokens == len(prompt)
    assert [c.token_ids for c in chat.choices] == [want.token_ids] * 2
    events = list(client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=5,
                                                 temperature=0, stream=True, extra_body=extra))
    assert events[0].prompt_token_ids == prompt
    assert [t for e in events for t in e.choices[0].token_ids] == want.token_ids
    plain = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
    assert getattr(plain, "prompt_token_ids", None) is None
    assert getattr(plain.choices[0], "token_ids", None) is None


def test_return_tokens_as_token_ids(server, client):
    """Logprob tokens as "token_id:N" (tokens that are no text alone stay identifiable);
    the offsets still count the text."""
    backend, _ = server
    name = backend.model_name
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    got = client.completions.create(model=name, prompt="Hello there", max_tokens=5, logprobs=2,
                                    temperature=0, extra_body=extra).choices[0]
    assert got.logprobs.tokens == [f"token_id:{t}" for t in got.token_ids]
    for token, top in zip(got.token_ids, got.logprobs.top_logprobs):
        assert len(top) == 2 and f"token_id:{token}" in top  # greedy: the likeliest
        assert all(k.startswith("token_id:") for k in top)
    texts = [backend.tokenizer.decode([t], skip_special_tokens=False) for t in got.token_ids]
    assert got.logprobs.text_offset == [sum(len(x) for x in texts[:i]) for i in range(5)]
    chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body=extra).choices[0]
    assert [e.token for e in chat.logprobs.content] == [f"token_id:{t}" for t in chat.token_ids]
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token.startswith("token_id:")
               for e in chat.logprobs.content)
    # bytes are the token's own text (as vLLM's), the top entries' their shown strings
    for entry, token in zip(chat.logprobs.content, chat.token_ids):
        assert entry.bytes == list(backend.tokenizer.decode(
            [token], skip_special_tokens=False).encode("utf-8", errors="replace"))
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)
    scored = client.completions.create(model=name, prompt=[5, 17, 29], max_tokens=1,
                                       extra_body={"prompt_logprobs": 1, **extra})
    for token, entry in zip([17, 29], scored.choices[0].prompt_logprobs[1:]):
        assert entry[str(token)]["decoded_token"] == backend.tokenizer.decode(
            [token], skip_special_tokens=False)


def test_prompt_logprobs(server, client, llama_dir):
    """vLLM's prompt_logprobs: per prompt position the prompt token's logprob and rank and the
    top-n's, keyed by token id; transformers' values; on completions choices and at the top
    of a chat response; refused with stream: true."""
    from transformers import AutoModelForCausalLM

    backend, port = server
    name = backend.model_name
    ids = [5 + (11 * i) % 300 for i in range(30)]
    got = client.completions.create(model=name, prompt=ids, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 3}).choices[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    entries = got.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry = entries[p]
        mine = entry[str(ids[p])]
        assert abs(mine["logprob"] - ref[p - 1, ids[p]].item()) < 1e-4
        assert mine["decoded_token"] == backend.tokenizer.decode([ids[p]],
                                                                 skip_special_tokens=False)
        row = ref[p - 1]
        low = 1 + int((row > row[ids[p]] + 1e-4).sum())
        assert low <= mine["rank"] <= 1 + int((row > row[ids[p]] - 1e-4).sum())
        top = [k for k, v in entry.items() if v["rank"] <= 3 and (k != str(ids[p])
                                                                  or mine["rank"] <= 3)]
        assert sorted(int(k) for k in top) == sorted(row.topk(3).indices.tolist())
        assert len(entry) == 3 + (mine["rank"] > 3)
    # With echo and logprobs 1 as well: the echo's entries keep their one top token.
    both = client.completions.create(model=name, prompt=ids, max_tokens=1, temperature=0,
                                     logprobs=1, echo=True,
                                     extra_body={"prompt_logprobs": 3}).choices[0]
    assert both.prompt_logprobs == entries
    assert all(len(t) == 1 for t in both.logprobs.top_logprobs[1:])
    chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    prompt = backend.tokenizer.encode_chat(MESSAGES)
    assert len(chat.prompt_logprobs) == len(prompt) and chat.prompt_logprobs[0] is None
    assert [list(e) for e in chat.prompt_logprobs[1:]] == [[str(t)] for t in prompt[1:]]
    # Logprobs of the output beside prompt_logprobs, without echo: the output's alone (the
    # prompt's are in prompt_logprobs), on completions and on chat.
    plain = client.completions.create(model=name, prompt=ids, max_tokens=3, temperature=0,
                                      logprobs=2, extra_body={"prompt_logprobs": 2,
                                                              "ignore_eos": True}).choices[0]
    assert len(plain.logprobs.tokens) == 3 and plain.logprobs.text_offset[0] == 0
    assert len(plain.prompt_logprobs) == len(ids)
    chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"prompt_logprobs": 1,
                                                      "ignore_eos": True})
    assert len(chat.choices[0].logprobs.content) == 3 and chat.prompt_logprobs[0] is None
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=name, prompt="x", max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"
    # 0 asks for nothing, which a stream can carry (as vLLM)
    events = list(client.completions.create(model=name, prompt="x", max_tokens=2, stream=True,
                                            extra_body={"prompt_logprobs": 0}))
    assert events and all(getattr(e.choices[0], "prompt_logprobs", None) is None
                          for e in events if e.choices)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=name, prompt="x", max_tokens=1,
                                  extra_body={"prompt_logprobs": 21})
    assert err.value.body["param"] == "prompt_logprobs"


def test_allowed_token_ids(server, client):
    """Only the allowed tokens are chosen (sampled, several seeds); the logprobs stay the
    model's own; ids outside the vocabulary or an empty list are a 400."""
    backend, _ = server
    name, vocab = backend.model_name, backend.tokenizer.vocab_size
    allowed = [7, 19, 203]
    for seed in range(4):
        got = client.completions.create(
            model=name, prompt="pick one", max_tokens=8, temperature=1.0, seed=seed, logprobs=0,
            extra_body={"allowed_token_ids": allowed, "return_token_ids": True,
                        "ignore_eos": True}).choices[0]
        assert set(got.token_ids) <= set(allowed)
        assert all(lp < 0 for lp in got.logprobs.token_logprobs)
    chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=4,
                                          temperature=0,
                                          extra_body={"allowed_token_ids": [11],
                                                      "return_token_ids": True})
    assert chat.choices[0].token_ids == [11] * 4
    # The logprob of a token chosen under allowed_token_ids is the model's own, as the
    # unrestricted request reports it for the same token.
    free = client.completions.create(model=name, prompt="pick one", max_tokens=1,
                                     temperature=0, logprobs=5,
                                     extra_body={"return_tokens_as_token_ids": True}).choices[0]
    second, value = sorted(free.logprobs.top_logprobs[0].items(), key=lambda kv: -kv[1])[1]
    token = [int(second.removeprefix("token_id:"))]
    forced = client.completions.create(
        model=name, prompt="pick one", max_tokens=1, temperature=0, logprobs=0,
        extra_body={"allowed_token_ids": token * 3, "return_token_ids": True}).choices[0]
    assert forced.token_ids == token
    assert abs(forced.logprobs.token_logprobs[0] - value) < 1e-5
    # Every allowed token ruled out from the start (a one-token bad word, EOS under
    # min_tokens): a 400, not a token from outside the list.
    one = next(t for t in range(300, 400) if _round_trips(backend.tokenizer, [t]))
    eos = min(backend.tokenizer.eos_token_ids)
    for extra in ({"allowed_token_ids": [one],
                   "bad_words": [backend.tokenizer.decode([one])]},
                  {"allowed_token_ids": [eos], "min_tokens": 2}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=name, prompt="x", max_tokens=4, extra_body=extra)
        assert err.value.body["param"] == "allowed_token_ids", extra
    for bad in ([vocab], [], [-1]):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=name, prompt="x", max_tokens=1,
                                      extra_body={"allowed_token_ids": bad})
        assert err.value.body["param"] == "allowed_token_ids", bad
    with pytest.raises(openai.BadRequestError) as err:  # the grammar decides what may follow
        client.completions.create(model=name, prompt="x", max_tokens=1,
                                  extra_body={"allowed_token_ids": [7],
                                              "guided_choice": ["yes", "no"]})
    assert err.value.body["param"] == "allowed_token_ids"


def _round_trips(tok, ids: list[int]) -> bool:
    text = tok.decode(ids, skip_special_tokens=False)
    return text == text.lstrip() and tok.encode(text, add_special_tokens=False) == ids


def test_bad_words(server, client, offline):
    """A bad word's last token is never chosen after the rest of it: greedy output that wrote
    a two-token word, and one that began with a one-token word, turn aside exactly there and
    match the unrestricted output until then; the same on chat."""
    backend, _ = server
    tok, name = backend.tokenizer, backend.model_name
    prompt = "The quick brown fox"
    free = offline.generate(prompt, greedy(24))[0].token_ids
    k = next((k for k in range(1, len(free) - 1) if _round_trips(tok, free[k:k + 2])
              and free[k + 1] not in free[:k + 1]), None)
    assert k is not None, "no two-token word to ban in the greedy output"
    word = tok.decode(free[k:k + 2], skip_special_tokens=False)
    got = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0,
                                    extra_body={"bad_words": [word], "ignore_eos": True,
                                                "return_token_ids": True}).choices[0]
    assert got.token_ids[:k + 1] == free[:k + 1] and got.token_ids[k + 1] != free[k + 1]
    assert all(got.token_ids[i:i + 2] != free[k:k + 2] for i in range(len(got.token_ids)))
    # The offline engine tokenizes the words itself: the same tokens.
    assert offline.generate(prompt, SamplingParams(max_tokens=24, temperature=0,
                                                   ignore_eos=True, bad_words=[word])
                            )[0].token_ids == got.token_ids
    first = free[0]
    if _round_trips(tok, [first]):
        one = client.completions.create(
            model=name, prompt=prompt, max_tokens=3, temperature=0,
            extra_body={"bad_words": [tok.decode([first])], "return_token_ids": True})
        assert first not in one.choices[0].token_ids
    for bad in ([" "], ["x" * 201], ["word"] * 101):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=name, prompt="x", max_tokens=1,
                                      extra_body={"bad_words": bad})
        assert err.value.body["param"] == "bad_words", bad


def test_cache_salt(server, client):
    """Requests share cached prompt blocks only under the same salt (vLLM's cache_salt); an
    unsalted request never hits a salted one's."""
    backend, _ = server
    name = backend.model_name
    prompt = [9 + (5 * i) % 250 for i in range(80)]

    def cached(**extra) -> int:
        got = client.completions.create(model=name, prompt=prompt, max_tokens=1,
                                        extra_body=extra)
        return got.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a-secret") == 0
    assert cached(cache_salt="tenant-a-secret") >= 64
    assert cached(cache_salt="someone-else") == 0
    assert cached() == 0
    assert cached() >= 64
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=name, prompt="x", max_tokens=1,
                                  extra_body={"cache_salt": ""})
    assert err.value.body["param"] == "cache_salt"
