"""Structured outputs in the engine (pd_runtime/engine/sampling/grammar.py): each kind of spec holds the
output to it, and a constrained request gives the same tokens alone or batched, colocated or
disaggregated, resumed after a lost worker, with speculation on or off."""

from __future__ import annotations

import functools
import json
import math
import re

import jsonschema
import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.api import InvalidRequestError
from tests.test_disaggregated_engine import disaggregated, dtype, pair, run_to_end  # noqa: F401

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 3},
                         "ok": {"type": "boolean"}}}
# Compact JSON: the random test model would otherwise fill max_tokens with whitespace.
JSON = {"json": SCHEMA, "disable_any_whitespace": True}
REGEX = {"regex": r"[a-z]{2,5}-[0-9]{1,3}"}
CHOICE = {"choice": ["alpha", "beta", "gamma delta"]}
GRAMMAR = {"grammar": 'start: "(" NUM ("+" NUM)? ("+" NUM)? ")"\nNUM: /[0-9]{1,2}/'}
SPECS = [JSON, REGEX, CHOICE, GRAMMAR]
PROMPTS = ["The answer is", "Once upon a time there was", "def f(x):", "Name and age:"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, num_kv_blocks=256)


def params(spec, i=0, greedy=False, **kw):
    sampling = dict(temperature=0.0) if greedy else dict(temperature=1.0, seed=11 + i)
    return SamplingParams(max_tokens=120, structured_outputs=spec, **sampling, **kw)


def holds(spec, text: str) -> bool:
    if "json" in spec:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if "regex" in spec:
        return re.fullmatch(spec["regex"], text) is not None
    if "choice" in spec:
        return text in spec["choice"]
    return re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2}){0,2}\)", text) is not None


@pytest.mark.parametrize("greedy", [True, False])
def test_each_kind_of_spec_holds_the_output(llm, greedy):
    outs = llm.generate([p for p in PROMPTS for _ in SPECS],
                        [params(s, i, greedy) for i, (_, s) in
                         enumerate((p, s) for p in PROMPTS for s in SPECS)])
    for i, out in enumerate(outs):
        spec = SPECS[i % len(SPECS)]
        assert out.finish_reason == "stop", (spec, out.text)
        assert holds(spec, out.text), (spec, out.text)
        assert out.token_ids[-1] in llm.engine.eos_token_ids  # the grammar's end, then EOS


def test_json_object_starts_an_object(llm):
    out = llm.generate(["x"], SamplingParams(max_tokens=40, temperature=0.0,
                                             structured_outputs={"json_object": True}))[0]
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


def test_same_tokens_alone_and_batched(llm):
    """Masks are per row: a constrained request's tokens do not depend on its batch, which
    mixes constrained and unconstrained requests."""
    free = SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)
    batch = llm.generate(PROMPTS + PROMPTS, [params(s, i) for i, s in enumerate(SPECS)]
                         + [free] * len(PROMPTS))
    for i, spec in enumerate(SPECS):
        alone = llm.generate([PROMPTS[i]], [params(spec, i)])[0]
        assert alone.token_ids == batch[i].token_ids and alone.text == batch[i].text


def test_disaggregated_and_resumed_equal_colocated(pair, llama_dir):  # noqa: F811
    """The prefill worker's first token is chosen under the grammar; the decode worker's
    matcher consumes it before its own first mask; a resumed request's matcher its resumed
    tokens."""
    prefill, decode = pair
    reference = LLM(llama_dir, dtype=prefill.config.dtype, num_kv_blocks=128)
    items = [(f"r{i}", reference.engine.tokenize_prompt(p)) for i, p in enumerate(PROMPTS)]
    sampling = [params(s, i) for i, s in enumerate(SPECS)]
    want = reference.generate([ids for _, ids in items], sampling)
    texts: dict = {}
    got = disaggregated(prefill, decode, items, sampling, texts)
    for (rid, _), out in zip(items, want):
        assert got[rid] == out.token_ids and texts[rid] == out.text, rid
    engine = reference.engine
    for (rid, ids), p, out in zip(items, sampling, want):
        cut = len(out.token_ids) // 2
        engine.add_request(rid, ids, p, resume_output_ids=out.token_ids[:cut])
        rest: dict = {}
        run_to_end(engine, rest)
        assert out.token_ids[:cut] + rest[rid] == out.token_ids, rid


def test_speculation_changes_nothing(llama_dir, llm):
    spec_llm = LLM(llama_dir, num_kv_blocks=256, speculative_method="ngram",
                   speculative_tokens=4, speculative_ngram_min=1)
    sampling = [params(s, i, greedy=True) for i, s in enumerate(SPECS)]
    want = llm.generate(PROMPTS, sampling)
    got = spec_llm.generate(PROMPTS, sampling)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = spec_llm.engine.speculator.stats
    assert stats.report()["drafted_tokens"] == 0
    # The same engine drafts for an unconstrained request that repeats itself.
    spec_llm.generate(["a b c a b c a b c a b c"], SamplingParams(max_tokens=24, temperature=0.0,
                                                                  ignore_eos=True))
    assert stats.report()["drafted_tokens"] > 0


def test_the_grammars_end_ends_the_request_under_ignore_eos(llm):
    out = llm.generate(["pick"], params(CHOICE, greedy=True, ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text in CHOICE["choice"]
    assert out.token_ids[-1] in llm.engine.eos_token_ids


def test_logprobs_of_ruled_out_tokens_stay_finite(llm):
    out = llm.generate(["pick"], params(CHOICE, greedy=True, logprobs=5))[0]
    values = [{t: lp.logprob for t, lp in entry.items()} for entry in out.logprobs]
    for token, entry in zip(out.token_ids, values):
        assert math.isfinite(entry[token]) and entry[token] > -9999
        assert all(-9999.0 <= v <= 0 for v in entry.values())
    json.dumps(values, allow_nan=False)  # an HTTP body can carry them
    # Where only EOS is allowed, everything else is reported at the floor.
    assert -9999.0 in values[-1].values()


@pytest.mark.parametrize("spec, says", [
    ({"regex": "a(b"}, "unclosed group"),
    ({"json": {"type": "nonsense"}}, "nonsense"),
    ({"json": "{not json"}, "not a JSON schema"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"choice": []}, "choice"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({}, "exactly one"),
    ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "boolean"),
    ("a", "must be an object"),
])
def test_bad_specs_are_refused_naming_the_field(spec, says):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(structured_outputs=spec)
    assert caught.value.param == "structured_outputs" and says in str(caught.value)


def test_min_tokens_with_a_grammar_is_refused():
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(min_tokens=3, max_tokens=8, structured_outputs=CHOICE)
    assert caught.value.param == "min_tokens"


def test_disable_additional_properties_closes_every_object(llm):
    """vLLM's disable_additional_properties: objects that leave additionalProperties out get
    false, nested ones too; a property named like a keyword is not taken for one."""
    from pd_runtime.structured import _closed

    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "items": {"type": "array", "items": {"type": "object"}}}}
    closed = _closed(json.loads(json.dumps(schema)))
    assert closed["additionalProperties"] is False
    inner = closed["properties"]
    assert inner["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in inner  # the property map itself is no schema
    assert inner["items"]["items"]["additionalProperties"] is False
    out = llm.generate(["x"], SamplingParams(
        max_tokens=80, temperature=0.0, structured_outputs={
            "json": {"type": "object", "properties": {"k": {"type": "boolean"}},
                     "required": ["k"]},
            "disable_additional_properties": True, "disable_any_whitespace": True}))[0]
    assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"k"}


def test_json_keys_come_in_the_schemas_order(llm):
    """As OpenAI documents and vLLM keeps: a schema's properties are generated in its order
    (a "reasoning" before an "answer"), not sorted."""
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha"],
              "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}}}
    out = llm.generate(["x"], SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={
        "json": schema, "disable_any_whitespace": True}))[0]
    assert out.text.startswith('{"zeta":'), out.text


def test_boolean_and_deep_schemas(llm):
    out = llm.generate(["x"], SamplingParams(max_tokens=8, temperature=0.0,
                                             structured_outputs={"json": True}))[0]
    assert out.token_ids  # anything goes: JSON Schema's true
    for spec, says in (({"json": False}, "nothing matches"),
                       ({"json": "[" * 3000 + "]" * 3000}, "not a JSON schema"),
                       ({"json": json.loads("[" * 300 + "]" * 300)}, "nested"),
                       ({"json": "{\"type\": NaN}"}, "NaN")):
        with pytest.raises(InvalidRequestError) as caught:
            SamplingParams(structured_outputs=spec)
        assert says in str(caught.value), spec


def test_a_long_chain_of_grammar_rules_runs(llm):
    """Thousands of chained rules (within the spec's size limit) are parsed recursively by
    llguidance: on a default stack they overflowed it and killed the process (SIGSEGV)."""
    rules = "\n".join(f'a{i}: "x" a{i + 1} | "y"' for i in range(2800))
    spec = {"grammar": f'start: a0\n{rules}\na2800: "z"'}
    out = llm.generate(["x"], SamplingParams(max_tokens=12, temperature=0.0,
                                             structured_outputs=spec))[0]
    assert set(out.text) <= set("xyz") and out.text


def test_both_ways_of_unpacking_the_masks_agree():
    """The host unpacking (CPU logits) and the device one (packed words copied, unpacked with
    shifts) give the same tokens, including the sign bit of each int32 word."""
    import numpy as np
    import torch

    from pd_runtime.engine.sampling.grammar import ruled_out_of

    bits = np.random.default_rng(0).integers(-(1 << 31), 1 << 31, size=(5, 9), dtype=np.int64)
    bits = bits.astype(np.int32)
    bits[0, 0] = -1  # every token of the first word allowed
    host = ruled_out_of(bits, torch.device("cpu"), on_host=True)
    device = ruled_out_of(bits, torch.device("cpu"), on_host=False)
    assert host.shape == (5, 9 * 32) and torch.equal(host, device)
    assert not host[0, :32].any()
    word, bit = 3, 31
    assert bool(host[1, word * 32 + bit]) == (not (int(bits[1, word]) >> bit) & 1)


@pytest.fixture(scope="module")
def thinking_tokenizer(llama_dir, tmp_path_factory):
    """The test tokenizer with <think> and </think> as added tokens that are not special, as
    Qwen3's and DeepSeek-R1's are (llguidance takes such `<...>` tokens for special ones, so a
    grammar could never spell them: the engine finds them by id)."""
    import shutil

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from pd_runtime.tokenizer import Tokenizer

    model = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(llama_dir, model)
    hf = HFTokenizer.from_file(str(model / "tokenizer.json"))
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t in ("<think>", "</think>")])
    hf.save(str(model / "tokenizer.json"))
    return Tokenizer(str(model))


def allowed_tokens(masks, request, width: int) -> set[int]:
    """The tokens `masks` leaves a request's next sample (its row of `width` logits)."""
    import torch

    logits = torch.zeros(1, width)
    masks.mask(logits, [(0, request)])
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


@pytest.mark.parametrize("mode, text", [("open", "hm, two</think>yes"),
                                        ("optional", "<think>hm\n</think>no"),
                                        ("optional", "yes")])
def test_a_grammar_holds_only_the_answer_after_the_thinking(thinking_tokenizer, mode, text):
    """A reasoning model's grammar (`think`, set by the router): every token is free until the
    think block's end tag (its own token), then the grammar holds the answer, then only EOS.
    Under "optional" the first token is the answer's or the block's start."""
    from types import SimpleNamespace

    from pd_runtime.engine.sampling.grammar import GrammarMasks

    tokenizer = thinking_tokenizer
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    (start,), (end,) = encode("<think>"), encode("</think>")
    width = max(tokenizer.vocab_size, start + 1, end + 1)
    masks = GrammarMasks(tokenizer, width)
    spec = {"choice": ["yes", "no"], "think": mode}
    request = SimpleNamespace(grammar=masks.start(SamplingParams(structured_outputs=spec)),
                              output_token_ids=[], request_id="r")

    def allowed() -> set[int]:
        return allowed_tokens(masks, request, width)

    newline = encode("\n")[0]
    if mode == "optional":
        first = allowed()
        assert start in first and encode("y")[0] in first and encode("h")[0] not in first
    thinking = mode == "open" or text.startswith("<think>")
    for token in encode(text):
        now = allowed()
        assert token in now, (text, tokenizer.decode(request.output_token_ids))
        if thinking and (mode == "open" or request.output_token_ids):  # free, to its end tag
            assert now == set(range(width))
        request.output_token_ids.append(token)
        if token == end:
            thinking = False
            assert newline not in allowed()  # the answer starts at once
    assert allowed() == set(tokenizer.eos_token_ids)


def test_a_reasoning_model_answers_under_the_grammar_after_its_end_tag(llama_dir,
                                                                        tmp_path_factory):
    """The engine end to end with a model whose vocabulary holds the tags: pushed to end its
    thinking at once (logit_bias on the end tag), it then answers under the grammar, alone
    and batched with an unconstrained request, and stops."""
    import shutil

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from pd_runtime.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("reasoner") / "model", preset="test",
                            vocab_size=640)
    hf = HFTokenizer.from_file(str(model / "tokenizer.json"))
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t in ("<think>", "</think>")])
    hf.save(str(model / "tokenizer.json"))
    llm = LLM(str(model), num_kv_blocks=128)
    (end,) = llm.engine.tokenizer.encode("</think>", add_special_tokens=False)
    spec = {"choice": ["yes", "no"], "think": "open"}
    params = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=spec,
                            logit_bias={end: 100.0}, skip_special_tokens=False)
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = llm.generate(["Is it?"], params)[0]
    batched = llm.generate(["Is it?", "Other"], [params, free])[0]
    assert alone.token_ids[0] == end and alone.finish_reason == "stop"
    assert alone.text.split("</think>", 1)[1] in ("yes", "no")
    assert batched.token_ids == alone.token_ids
    # EOS while thinking does not end a request under ignore_eos (only a complete grammar's).
    eos = sorted(llm.engine.eos_token_ids)[0]
    ignored = llm.generate(["Is it?"], SamplingParams(
        max_tokens=6, temperature=0.0, structured_outputs=spec, ignore_eos=True,
        logit_bias={eos: 100.0}))[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 6
    shutil.rmtree(model)
