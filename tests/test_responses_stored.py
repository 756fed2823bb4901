"""A stored response after its request, with the official `openai` client
(pd_runtime/entrypoints/openai/responses/stored.py): its events streamed again from a sequence
number, the input items it was made from (a previous_response_id chain's included) in pages, and
deleting it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.router_support.served_model import client, server  # noqa: F401 (fixtures)

SAMPLING = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_a_streamed_response_streams_again_from_a_sequence_number(client):  # noqa: F811
    model = client.models.list().data[0].id
    events = list(client.responses.create(model=model, input="Count.", max_output_tokens=6,
                                          stream=True, **SAMPLING))
    response = events[-1].response
    again = list(client.responses.retrieve(response.id, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
    later = list(client.responses.retrieve(response.id, stream=True, starting_after=3))
    assert [e.sequence_number for e in later] == list(range(4, len(events)))
    assert later[-1].response.model_dump() == response.model_dump()
    with pytest.raises(openai.BadRequestError) as raised:  # one made without stream: no events
        plain = client.responses.create(model=model, input="hi", max_output_tokens=2)
        list(client.responses.retrieve(plain.id, stream=True))
    assert raised.value.body["param"] == "stream"
    loose = client.responses.create(model=model, input="hi", max_output_tokens=2, stream=True,
                                    store=False)
    loose_id = list(loose)[-1].response.id
    with pytest.raises(openai.NotFoundError):  # not stored: not read back
        list(client.responses.retrieve(loose_id, stream=True))


def test_input_items_are_the_conversation_it_was_made_from(client):  # noqa: F811
    """Newest first by default; a chain's earlier turns (their answers as output messages and
    calls) come before this request's input; pages follow `after`; ids stay the same."""
    model = client.models.list().data[0].id
    first = client.responses.create(
        model=model, instructions="Be brief.", max_output_tokens=4, **SAMPLING,
        input=[{"role": "developer", "content": "Use tools."},
               {"role": "user", "content": "Weather?"},
               {"type": "function_call", "call_id": "call_1", "name": "weather",
                "arguments": "{\"city\": \"Oslo\"}"},
               {"type": "function_call_output", "call_id": "call_1", "output": "rain"}])
    second = client.responses.create(model=model, input="And tomorrow?", max_output_tokens=4,
                                     previous_response_id=first.id, **SAMPLING)
    items = list(client.responses.input_items.list(second.id, order="asc"))
    assert [i.type for i in items] == ["message", "message", "function_call",
                                       "function_call_output", "message", "message"]
    assert [getattr(i, "role", None) for i in items] == ["developer", "user", None, None,
                                                         "assistant", "user"]
    assert items[1].content[0].text == "Weather?" and items[-1].content[0].text == "And tomorrow?"
    assert items[2].call_id == "call_1" and items[2].arguments == "{\"city\": \"Oslo\"}"
    assert items[3].output == "rain"
    assert items[4].content[0].text == first.output_text  # the first answer
    assert len({i.id for i in items}) == len(items)
    newest_first = list(client.responses.input_items.list(second.id))
    assert [i.id for i in newest_first] == [i.id for i in reversed(items)]
    page = client.responses.input_items.list(second.id, limit=2, order="asc")
    assert [i.id for i in page.data] == [i.id for i in items[:2]] and page.has_more
    paged = [i.id for i in page]  # the client's auto-pagination follows `after`
    assert paged == [i.id for i in items]
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.input_items.list(second.id, limit=101)
    assert raised.value.body["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nothing")


def test_a_deleted_response_is_gone(client):  # noqa: F811
    model = client.models.list().data[0].id
    kept = client.responses.create(model=model, input="Remember 7.", max_output_tokens=3)
    base = str(client.base_url).rstrip("/")
    deleted = httpx.delete(f"{base}/responses/{kept.id}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": kept.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(kept.id)
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(model=model, input="Which?", previous_response_id=kept.id)
    assert raised.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):  # the official client's call, a second time
        client.responses.delete(kept.id)
    other = client.responses.create(model=model, input="hi", max_output_tokens=2)
    assert client.responses.delete(other.id) is None  # the client returns nothing on success
    run = httpx.get(f"{base}/runs/{kept.id}").json()  # its record (what it is billed by) stays
    assert run["state"] == "completed" and run["output_tokens"] == 3


def test_another_replica_deletes_it_through_the_store(store_url):
    """Replica B deletes a response replica A made (B reads it from the shared store only,
    SQLite or PostgreSQL); a run still going is a 409, another tenant's a 404."""
    import asyncio

    from pd_runtime.gateway.open import open_store
    from pd_runtime.entrypoints.openai.responses import stored as responses_stored
    from pd_runtime.router.backend import BackendError
    from pd_runtime.gateway.recorder import RunRecorder

    def recorder(owner):
        return RunRecorder(open_store(store_url), store_url, owner)

    async def scenario():
        a, b = recorder("a:1/0"), recorder("b:1/0")
        done, _ = await a.open("resp_done", "acme", False, None, None)
        for state in ("prefilling", "streaming"):
            a.advance(done, state)
        done.body, done.conversation = b'{"id": "resp_done"}', b'[{"role": "user"}]'
        a.finish(done, "completed")
        going, _ = await a.open("resp_going", "acme", False, None, None)
        a.advance(going, "prefilling")
        await asyncio.to_thread(a.writer.flush, 5.0)
        for run_id, tenant, status in (("resp_going", "acme", 409), ("resp_done", "other", 404)):
            with pytest.raises(BackendError) as refused:
                await responses_stored.delete(b, tenant, run_id)
            assert refused.value.status == status
        assert await responses_stored.stored(b, "resp_done", "acme") is not None
        assert await responses_stored.delete(b, "acme", "resp_done") == {
            "id": "resp_done", "object": "response", "deleted": True}
        assert await responses_stored.stored(b, "resp_done", "acme") is None
        with pytest.raises(BackendError) as again:
            await responses_stored.delete(b, "acme", "resp_done")
        assert again.value.status == 404
        a.finish(going, "cancelled")
        await asyncio.to_thread(b.close)
        await asyncio.to_thread(a.close)

    asyncio.run(scenario())


def test_truncation_auto_drops_the_oldest_turns_that_do_not_fit(client):  # noqa: F811
    """A conversation past the context: a 400 as it is, and with truncation "auto" the answer
    the chat endpoint gives to the instructions and the latest turns that fit (a call and its
    output dropped together), which are what it stores."""
    model = client.models.list().data[0].id
    turns = []
    for i in range(12):
        turns += [{"role": "user", "content": f"Turn {i}: " + "tell me more " * 40},
                  {"role": "assistant", "content": "more words " * 30}]
    turns[3:3] = [{"type": "function_call", "call_id": "call_9", "name": "f",
                   "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "call_9", "output": "ok"}]
    turns.append({"role": "user", "content": "And now?"})
    ask = dict(model=model, instructions="Be brief.", input=turns, max_output_tokens=8,
               **SAMPLING)
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(**ask)
    assert raised.value.body["code"] == "context_length_exceeded"
    assert raised.value.body["param"] == "input"
    fitted = client.responses.create(**ask, truncation="auto")
    assert fitted.truncation == "auto" and fitted.usage.input_tokens + 8 <= 2048
    chat_turns = [{"role": m["role"], "content": m["content"]} for m in turns
                  if "role" in m]  # the call and its output are in the first turns, dropped
    starts = [i for i, m in enumerate(chat_turns) if m["role"] == "user"]
    for start in starts:  # the fewest turns dropped that fit, found by the chat endpoint
        try:
            chat = client.chat.completions.create(
                model=model, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True},
                messages=[{"role": "system", "content": "Be brief."}] + chat_turns[start:])
            break
        except openai.BadRequestError:
            continue
    assert start > 0 and fitted.output_text == chat.choices[0].message.content
    assert fitted.usage.input_tokens == chat.usage.prompt_tokens
    # What is stored is what it was given: a chain's conversation stays within the context.
    items = list(client.responses.input_items.list(fitted.id, order="asc", limit=100))
    assert [i.content[0].text for i in items] == [m["content"] for m in chat_turns[start:]]
    with pytest.raises(openai.BadRequestError):  # even its last turn alone is too long
        client.responses.create(model=model, input="word " * 3000, truncation="auto")


def test_truncation_auto_drops_an_agent_loops_oldest_steps(client):  # noqa: F811
    """One request followed by more calls and outputs than fit (an agent's loop): its oldest
    steps go (a call with its output), the request itself stays; the answer is the chat
    endpoint's to the same messages, and they are what is stored."""
    model = client.models.list().data[0].id
    task = {"role": "user", "content": "Fix the build."}
    steps = []
    for i in range(30):
        steps += [{"type": "function_call", "call_id": f"call_{i}", "name": "shell",
                   "arguments": json.dumps({"cmd": f"make step{i}"})},
                  {"type": "function_call_output", "call_id": f"call_{i}",
                   "output": f"step {i}: " + "compiler output line " * 25}]
    ask = dict(model=model, instructions="Be brief.", input=[task, *steps],
               max_output_tokens=8, **SAMPLING)
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(**ask)
    assert raised.value.body["code"] == "context_length_exceeded"
    fitted = client.responses.create(**ask, truncation="auto")
    items = list(client.responses.input_items.list(fitted.id, order="asc", limit=100))
    assert items[0].content[0].text == "Fix the build."
    kept = [i.call_id for i in items[1:]]
    first = int(kept[0].removeprefix("call_"))
    assert 0 < first < 29 and kept == [f"call_{i}" for i in range(first, 30) for _ in "ab"]
    assert [i.type for i in items[1:3]] == ["function_call", "function_call_output"]

    def chat_messages(start: int) -> list[dict]:
        out = [{"role": "system", "content": "Be brief."}, task]
        for step in steps[2 * start:]:
            if step["type"] == "function_call":
                out.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": step["call_id"], "type": "function", "function": {
                        "name": step["name"], "arguments": step["arguments"]}}]})
            else:
                out.append({"role": "tool", "tool_call_id": step["call_id"],
                            "content": step["output"]})
        return out

    chat = client.chat.completions.create(model=model, max_tokens=8, temperature=0.0,
                                          messages=chat_messages(first),
                                          extra_body={"ignore_eos": True})
    assert fitted.output_text == chat.choices[0].message.content
    assert fitted.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):  # one step more would have fit: not dropped
        client.chat.completions.create(model=model, max_tokens=8, messages=chat_messages(
            first - 1), extra_body={"ignore_eos": True})


def test_truncation_never_keeps_an_output_whose_call_it_dropped(llama_dir):
    """Parallel calls each after its own reasoning come as several assistant messages before
    their outputs: no cut falls between a call and its output, at any context length."""
    from pd_runtime.tokenizer import Tokenizer
    from pd_runtime.entrypoints.openai.responses.request import prepare_responses

    tokenizer = Tokenizer(llama_dir)
    thought = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]}
    items = [{"role": "user", "content": "Fix the build."}]
    for s in range(0, 12, 2):
        for i in (s, s + 1):
            items += [thought, {"type": "function_call", "call_id": f"call_{i}", "name": "sh",
                                "arguments": json.dumps({"cmd": f"make {i} " + "x " * 60})}]
        items += [{"type": "function_call_output", "call_id": f"call_{i}", "output": "ok " * 5}
                  for i in (s, s + 1)]
    cut = 0
    for max_len in range(200, 1200, 20):
        try:
            kept = prepare_responses({"model": "m", "input": items, "truncation": "auto",
                                      "max_output_tokens": 4}, tokenizer, "m",
                                     max_len).responses.messages
        except Exception:
            continue
        called = {c["id"] for m in kept for c in m.get("tool_calls") or ()}
        assert all(m["tool_call_id"] in called for m in kept if m["role"] == "tool"), max_len
        assert kept[0]["content"] == "Fix the build."
        cut += len(kept) < 1 + 6 * 6
    assert cut > 3  # it did cut, at several lengths


def test_an_unknown_response_is_a_404_without_the_wait_for_an_end(client):  # noqa: F811
    """A response id no run has: 404 after UNKNOWN_WAIT_S (the rounds in which another
    replica writes a new run's row), not after STORED_WAIT_S (kept for an end being written);
    as a previous_response_id too."""
    import time

    from pd_runtime.entrypoints.openai.responses.stored import STORED_WAIT_S, UNKNOWN_WAIT_S

    assert UNKNOWN_WAIT_S < STORED_WAIT_S
    model = client.models.list().data[0].id
    for ask in (lambda: client.responses.retrieve("resp_nosuchresponse"),
                lambda: client.responses.create(model=model, input="hi", max_output_tokens=2,
                                                previous_response_id="resp_nosuchresponse")):
        began = time.monotonic()
        with pytest.raises(openai.NotFoundError):
            ask()
        assert time.monotonic() - began < STORED_WAIT_S
