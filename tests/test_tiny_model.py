"""make_tiny_model: deterministic bytes, loadable by transformers for every architecture, sane logits."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from pd_runtime.model.tiny import PRESETS, SPECIAL_TOKENS, make_tiny_model

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]
TEXT = "Héllo wörld, it's 2024! Crème brûlée — 你好世界 🙂👩‍💻\n\tdone."
PROMPTS = ["The quick brown fox", "Hello, world! 你好", "def f(x):", "1, 2, 3,", "Once upon a time",
           "café 🚀"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, architecture=arch) for arch in ARCHITECTURES}


def test_same_arguments_give_identical_bytes(tmp_path):
    first = make_tiny_model(tmp_path / "a", seed=3)
    second = make_tiny_model(tmp_path / "b", seed=3)
    for name in ["model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json",
                 "generation_config.json", "special_tokens_map.json"]:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other_seed = make_tiny_model(tmp_path / "c", seed=4)
    assert (other_seed / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    assert (other_seed / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_transformers_loads_and_runs_each_architecture(tiny_dirs, arch):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch])
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    names = {name for name, _ in model.named_parameters()}
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (arch == "qwen3")
    ids = AutoTokenizer.from_pretrained(tiny_dirs[arch])(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], PRESETS["test"]["vocab_size"])
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tokenizer_round_trips_and_renders_chat(tiny_dirs, arch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[arch])
    assert len(tokenizer) == PRESETS["test"]["vocab_size"]
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(len(SPECIAL_TOKENS)))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 4)
    ids = tokenizer(TEXT).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n"
                        "<|im_start|>assistant\n")
    generation = json.loads((tiny_dirs[arch] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 3] and generation["bos_token_id"] == 0


def test_logits_are_spread_and_greedy_does_not_collapse(tiny_dirs):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    collapsed = 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(ids).logits[0]
        assert logits.std(dim=-1).min() > 2.0
        top2 = logits[-1].topk(2).values
        assert top2[0] - top2[1] > 1e-3  # no exact ties for greedy comparisons to trip on
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        collapsed += len(set(out[0, ids.shape[1]:].tolist())) == 1
    assert collapsed <= 1


def test_overrides_pad_vocab_tie_embeddings_and_scale_rope(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256}
    path = make_tiny_model(tmp_path, vocab_size=640, tie_word_embeddings=True, num_hidden_layers=3,
                           rope_scaling=rope, rope_theta=500000.0)
    config = json.loads((path / "config.json").read_text())
    assert config["rope_parameters"] == {**rope, "rope_theta": 500000.0}
    assert config["rope_theta"] == 500000.0 and config["rope_scaling"] == rope  # legacy readers
    assert config["num_hidden_layers"] == 3 and config["vocab_size"] == 640
    with safe_open(path / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in weights.keys()
        embed = weights.get_tensor("model.embed_tokens.weight")
    assert embed.shape == (640, 64) and not embed[512:].any() and embed[:512].std() > 0
    assert len(AutoTokenizer.from_pretrained(path)) == 512
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_bench_preset_is_31_8m_bf16_parameters(tmp_path):
    path = make_tiny_model(tmp_path, preset="bench")
    with safe_open(path / "model.safetensors", "pt") as weights:
        tensors = {name: weights.get_slice(name) for name in weights.keys()}
        count = sum(torch.Size(t.get_shape()).numel() for t in tensors.values())
        assert {t.get_dtype() for t in tensors.values()} == {"BF16"}
    assert abs(count - 31.8e6) < 0.1e6
    assert len(AutoTokenizer.from_pretrained(path)) == 8000


def test_unknown_preset_or_architecture_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        make_tiny_model(tmp_path, preset="huge")
    with pytest.raises(ValueError, match="architecture"):
        make_tiny_model(tmp_path, architecture="gpt2")


def test_a_max_model_len_past_the_models_context_is_refused(llama_dir):
    """As vLLM refuses it (it was cut down to the model's context without a word)."""
    from pd_runtime.config import EngineConfig, FieldValueError
    from pd_runtime.engine.engine import LLMEngine

    with pytest.raises(FieldValueError, match=r"max_model_len.*4096 exceeds .*context \(2048"):
        LLMEngine(EngineConfig(model=llama_dir, dtype="float32", num_kv_blocks=16,
                               max_model_len=4096))
    assert LLMEngine(EngineConfig(model=llama_dir, dtype="float32", num_kv_blocks=16,
                                  max_model_len=2048)).max_model_len == 2048


def test_sliding_windows_are_read_per_layer_and_keep_the_context(tmp_path):
    """A sliding-window model serves its whole context (attention over each query's window:
    tests/test_model_vs_transformers.py); which layers the window applies to is read as
    transformers reads it: Mistral's every layer, Qwen2's only with use_sliding_window and
    from max_window_layers on, a config's own layer_types first."""
    from pd_runtime.config import EngineConfig
    from pd_runtime.engine.engine import LLMEngine
    from pd_runtime.model.model_config import load_model_config

    path = make_tiny_model(tmp_path / "swa", architecture="mistral", sliding_window=24)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16))
    assert engine.max_model_len > 24 and engine.runner.model.windows == [24, 24]
    assert LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16,
                                  max_model_len=48)).max_model_len == 48
    full = make_tiny_model(tmp_path / "full", architecture="mistral")  # Mistral v0.2+: no window
    assert load_model_config(full).sliding_window is None
    qwen = make_tiny_model(tmp_path / "qwen", architecture="qwen2", sliding_window=24)
    config_file = qwen / "config.json"
    raw = json.loads(config_file.read_text())
    layers = raw["num_hidden_layers"]
    for use, window_layers, want in [(None, None, ()), (True, layers, ()), (True, 1, (1,)),
                                     (True, 0, (0, 1))]:
        raw.pop("use_sliding_window", None)  # absent: transformers' default, off
        raw.pop("layer_types", None)
        if use is not None:  # (transformers writes sliding_window null while it is off)
            raw.update(use_sliding_window=use, max_window_layers=window_layers, sliding_window=24)
        config_file.write_text(json.dumps(raw))
        assert load_model_config(qwen).window_layers == want, (use, window_layers)
    raw["layer_types"] = ["sliding_attention", "full_attention"]
    config_file.write_text(json.dumps(raw))
    assert load_model_config(qwen).window_layers == (0,)


@pytest.mark.parametrize("architecture, fields", [
    ("qwen2", {"max_window_layers": 3}), ("qwen3", {"max_window_layers": 1}),
    ("qwen2_moe", {"max_window_layers": 3}), ("qwen2_moe", {"max_window_layers": 8}),
    ("qwen3_moe", {}), ("smollm3", {"no_rope_layer_interval": 3}), ("mistral", {}),
    ("gemma3", {"sliding_window_pattern": 3}),
])
def test_windowed_layers_without_layer_types_are_transformers_own(tmp_path, architecture,
                                                                  fields):
    """A config.json that names no layer_types (as the Hub's older files): the layers we window
    are the ones transformers' config class marks "sliding_attention"."""
    from transformers import AutoConfig

    from pd_runtime.model.model_config import load_model_config

    window = {} if architecture in ("mistral", "gemma3") else {"use_sliding_window": True}
    path = make_tiny_model(tmp_path / "m", architecture=architecture, num_hidden_layers=8,
                           sliding_window=16, **window, **fields)
    config_file = path / "config.json"
    raw = json.loads(config_file.read_text())
    raw.pop("layer_types", None)
    raw.pop("_sliding_window_pattern", None)
    raw.update(fields)
    config_file.write_text(json.dumps(raw))
    theirs = AutoConfig.from_pretrained(path)
    types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * 8
    want = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    assert load_model_config(path).window_layers == want
