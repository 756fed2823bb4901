"""Model families' configs and checkpoints read as transformers reads them: fields a Hub
file leaves to its config class, the variants refused by name, the text models inside
multimodal checkpoints, and q/k computed bit for bit in bf16 where a family's order is its own
(tests/test_model_vs_transformers.py compares whole models' logits and tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pd_runtime import LLM, SamplingParams
from pd_runtime.model.model_config import ModelLoadError
from pd_runtime.tokenizer import Tokenizer
from tests.test_loading_and_text import copy_model


def test_a_phi3_sliding_window_is_read_and_the_context_kept(model_factory):
    """Phi-3-mini-4k's sliding_window (2047) applies whenever set, on every layer, as
    transformers reads it; the context stays the model's (tests/test_model_vs_transformers.py:
    the windowed attention is transformers')."""
    from pd_runtime.model.model_config import context_limit, load_model_config

    windowed = load_model_config(model_factory("phi3", sliding_window=64))
    assert (windowed.sliding_window, windowed.window_layers) == (64, (0, 1))
    assert context_limit(windowed, None) == 2048
    plain = load_model_config(model_factory("phi3"))
    assert plain.sliding_window is None and plain.window_layers == ()


def test_smollm3_rope_layers_are_read_as_transformers_reads_them(model_factory, tmp_path):
    """no_rope_layers (1: the layer rotates) or, without it, every no_rope_layer_interval-th
    layer unrotated; a list that does not cover the layers is refused naming the field; the
    KV identity differs with the layers (a handshake between pools tells them apart)."""
    from pd_runtime.model.model_config import load_model_config

    path = copy_model(model_factory("smollm3"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    for flags, nope in (([1, 0], (1,)), ([0, 0], (0, 1)), ([1, 1], ())):
        (path / "config.json").write_text(json.dumps({**cfg, "no_rope_layers": flags}))
        assert load_model_config(path).nope_layers == nope
    identities = set()
    for flags in ([1, 0], [0, 1]):
        (path / "config.json").write_text(json.dumps({**cfg, "no_rope_layers": flags}))
        identities.add(load_model_config(path).identity)
    assert len(identities) == 2
    unset = {k: v for k, v in cfg.items() if k != "no_rope_layers"}
    (path / "config.json").write_text(json.dumps({**unset, "num_hidden_layers": 8}))
    assert load_model_config(path).nope_layers == (3, 7)
    (path / "config.json").write_text(json.dumps({**cfg, "no_rope_layers": [1, 0, 0, 0]}))
    assert load_model_config(path).nope_layers == (1,)  # at least one flag per layer
    (path / "config.json").write_text(json.dumps({**cfg, "no_rope_layers": [1]}))
    with pytest.raises(ModelLoadError, match="no_rope_layers must hold a flag for each of"):
        load_model_config(path)
    # SmolLM3Config's own defaults where a hand-written file leaves them out.
    bare = {k: v for k, v in cfg.items() if k not in ("tie_word_embeddings", "rope_parameters",
                                                      "rope_theta", "rope_scaling")}
    (path / "config.json").write_text(json.dumps(bare))
    model = load_model_config(path)
    assert model.tie_word_embeddings and model.rope.theta == 2e6


def test_gemma3_configs_as_the_hub_writes_them(model_factory, tmp_path):
    """Gemma 3's config.json on the Hub (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern, no layer_types) reads as transformers 5 writes it (rope_parameters
    and layer_types per layer type); a soft-capping value that is no positive number is refused
    by name."""
    from pd_runtime.model.model_config import load_model_config

    path = copy_model(model_factory("gemma3", num_hidden_layers=6, sliding_window=16,
                                    layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                    rope_parameters={
                                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default",
                                                              "rope_theta": 1e4}}), tmp_path / "m")
    modern = load_model_config(path)
    assert (modern.window_layers, modern.rope.factor, modern.local_rope.theta) == \
        ((0, 1, 2, 3, 4), 8.0, 1e4)
    cfg = json.loads((path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        cfg.pop(key, None)
    cfg.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(path) == modern
    cfg["final_logit_softcapping"] = 30.0
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(path).final_softcap == 30.0
    cfg["final_logit_softcapping"] = -1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="final_logit_softcapping must be a positive"):
        load_model_config(path)


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_gemma3_text_model_inside_a_multimodal_checkpoint(model_factory, tmp_path, prefix):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: the text model's tensors under
    the Hub's prefix (or transformers 5's), its config under text_config with transformers'
    defaults left out, a vision tower beside it (not read, logged). Served as its text model:
    the same logits as the causal LM with those weights."""
    from pd_runtime.model.model_config import load_model_config

    source = Path(model_factory("gemma3", sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"]))
    path = copy_model(str(source), tmp_path / "mm")
    tensors = load_file(str(source / "model.safetensors"))
    renamed = {prefix + n.removeprefix("model."): t for n, t in tensors.items()}
    renamed["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3)
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((source / "config.json").read_text())
    text["model_type"] = "gemma3_text"
    for key in ("rms_norm_eps", "hidden_activation", "tie_word_embeddings", "architectures"):
        text.pop(key, None)  # left to Gemma3TextConfig's defaults, as the Hub's files leave them
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": text, "vision_config": {"model_type": "siglip_vision_model"},
        "torch_dtype": "float32"}))
    want, got = load_model_config(source), load_model_config(path)
    assert (got.family, got.rms_norm_eps, got.tie_word_embeddings) == ("gemma3", 1e-6, True)
    assert got.rope == want.rope and got.local_rope == want.local_rope \
        and got.window_layers == want.window_layers
    ids = Tokenizer(str(source)).encode("The quick brown fox jumps over the lazy dog")
    logits = [LLM(str(p), dtype="float32", num_kv_blocks=16, max_model_len=256).generate(
        [ids], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0].outputs[0].logprobs
              for p in (source, path)]
    assert logits[0] == logits[1]


def test_mistral3_text_model_inside_a_multimodal_checkpoint(model_factory, tmp_path):
    """Mistral Small 3.1/3.2 ship as Mistral3ForConditionalGeneration: a Mistral text model
    under language_model. (its config under text_config, no window), a vision tower and
    projector beside it (not read). Served as its text model: the causal LM's logits."""
    from pd_runtime.model.model_config import load_model_config

    source = Path(model_factory("mistral"))
    path = copy_model(str(source), tmp_path / "mm")
    tensors = load_file(str(source / "model.safetensors"))
    renamed = {("language_model." + n) if n.startswith(("model.", "lm_head.")) else n: t
               for n, t in tensors.items()}
    renamed["multi_modal_projector.linear_1.weight"] = torch.zeros(4, 3)
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((source / "config.json").read_text())
    text.pop("architectures")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
        "text_config": {**text, "sliding_window": None},
        "vision_config": {"model_type": "pixtral"}, "image_token_index": 10,
        "torch_dtype": "float32"}))
    got = load_model_config(path)
    assert (got.family, got.sliding_window) == ("mistral", None)
    config = json.loads((path / "config.json").read_text())
    for text_type, beta in (("ministral3", None), ("mistral", 0.1)):  # variants: refused
        text = {**config["text_config"], "model_type": text_type}
        if beta is not None:
            text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6,
                                       "llama_4_scaling_beta": beta}
        (path / "config.json").write_text(json.dumps({**config, "text_config": text}))
        with pytest.raises(ModelLoadError, match="ministral3|llama_4_scaling_beta"):
            load_model_config(path)
    (path / "config.json").write_text(json.dumps(config))
    assert got.identity == load_model_config(source).identity
    ids = Tokenizer(str(source)).encode("The quick brown fox jumps over the lazy dog")
    logits = [LLM(str(p), dtype="float32", num_kv_blocks=16, max_model_len=256).generate(
        [ids], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0].outputs[0].logprobs
              for p in (source, path)]
    assert logits[0] == logits[1]


def test_the_first_gemmas_config_reads_as_transformers_reads_it(tmp_path):
    """Gemma 2B's config.json as the Hub ships it (hidden_act "gelu", the first releases'
    name for the tanh approximation), and one left to GemmaConfig's defaults."""
    from transformers import GemmaConfig

    from pd_runtime.model.model_config import load_model_config

    hub = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_act": "gelu",
           "hidden_size": 2048, "intermediate_size": 16384, "num_attention_heads": 8,
           "num_hidden_layers": 18, "num_key_value_heads": 1, "head_dim": 256,
           "vocab_size": 256000, "rope_theta": 10000.0, "rms_norm_eps": 1e-06}
    for raw in (hub, {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}):
        (tmp_path / "config.json").write_text(json.dumps(raw))
        ours = load_model_config(tmp_path)
        theirs = GemmaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
        assert (ours.family, ours.mlp_act, ours.gemma_norms, ours.block_norms) == \
            ("gemma", "gelu_tanh", True, "pre")
        assert theirs.hidden_act == "gelu_pytorch_tanh"
        assert (ours.num_layers, ours.num_kv_heads, ours.head_dim, ours.hidden_size,
                ours.tie_word_embeddings, ours.embedding_multiplier) == \
            (theirs.num_hidden_layers, theirs.num_key_value_heads, theirs.head_dim,
             theirs.hidden_size, theirs.tie_word_embeddings, theirs.hidden_size ** 0.5)
    (tmp_path / "config.json").write_text(json.dumps({**hub, "hidden_act": "relu"}))
    with pytest.raises(ModelLoadError, match="hidden_act 'relu' is not supported"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hub, "use_bidirectional_attention": True}))
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        load_model_config(tmp_path)


@pytest.mark.parametrize("family, arch, prefix", [
    ("qwen2", "Qwen2_5_VLForConditionalGeneration", "model."),  # the Hub's names
    ("qwen3", "Qwen3VLForConditionalGeneration", "model.language_model.")])
def test_qwen_vl_text_model_gives_transformers_text_logits(model_factory, tmp_path, family, arch,
                                                          prefix):
    """Qwen2.5-VL and Qwen3-VL served as their text models: multimodal rope (its sections,
    interleaved or not) turns text as plain rope; the vision tower is not read. Our logits are
    transformers' own VL model's on text (its vision weights missing, initialized)."""
    from transformers import AutoModelForImageTextToText

    from pd_runtime.model.model_config import load_model_config

    source = Path(model_factory(family))
    path = copy_model(str(source), tmp_path / "vl")
    tensors = load_file(str(source / "model.safetensors"))
    renamed = {(prefix + n.removeprefix("model.")) if n.startswith("model.") else n: t
               for n, t in tensors.items()}
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((source / "config.json").read_text())
    text.pop("architectures")
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": 64, "spatial_merge_size": 2, "temporal_patch_size": 2}
    if family == "qwen2":  # Qwen2.5-VL's file: the text fields at the top, mrope named so
        config = {**text, "model_type": "qwen2_5_vl",
                  "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                  "vision_config": {**vision, "patch_size": 14, "fullatt_block_indexes": [0],
                                    "window_size": 112}}
    else:  # Qwen3-VL's: under text_config, interleaved sections
        config = {"model_type": "qwen3_vl", "tie_word_embeddings": text["tie_word_embeddings"],
                  "text_config": {**text, "model_type": "qwen3_vl_text", "rope_scaling": {
                      "rope_type": "default", "mrope_section": [2, 3, 3],
                      "mrope_interleaved": True}},
                  "vision_config": {**vision, "patch_size": 16,
                                    "deepstack_visual_indexes": [0],
                                    "num_position_embeddings": 16}}
    config.update(architectures=[arch], image_token_id=5, video_token_id=6,
                  vision_start_token_id=7)
    (path / "config.json").write_text(json.dumps(config))
    assert load_model_config(path).family == family
    ids = Tokenizer(str(source)).encode("The quick brown fox jumps over the lazy dog")
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    from tests.test_model_vs_transformers import our_logits

    from pd_runtime.model.loader import load_model

    got = our_logits(load_model(path, dtype="float32"), [ids])[0]
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


@pytest.mark.parametrize("family", ["olmo2", "cohere"])
def test_q_and_k_turn_as_transformers_in_bfloat16(model_factory, family):
    """In bf16, q and k are transformers' own, bit for bit: OLMo 2's normed over all heads,
    then turned by rope in float32 over float32 tables; Command R+'s normed head by head (its
    LayerNorms), then turned in neighbouring pairs in float32 over bf16 tables. A rope applied
    in bf16 differs."""
    import importlib

    from transformers import AutoModelForCausalLM

    from pd_runtime.model.loader import load_model

    path = model_factory(family, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=512, **({"use_qk_norm": True}
                                                   if family == "cohere" else {}))
    ours = load_model(path, dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    turn = importlib.import_module(f"transformers.models.{family}.modeling_{family}") \
        .apply_rotary_pos_emb
    x = torch.randn(1, 300, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    positions = torch.arange(300)
    attn = hf.model.layers[0].self_attn
    with torch.no_grad():
        cos, sin = hf.model.rotary_emb(x, positions[None])
        if family == "olmo2":  # normed over all heads, then split
            q = attn.q_norm(attn.q_proj(x)).view(1, 300, 4, 64)
            k = attn.k_norm(attn.k_proj(x)).view(1, 300, 2, 64)
        else:  # split, then each head by its own weights
            q = attn.q_norm(attn.q_proj(x).view(1, 300, 4, 64))
            k = attn.k_norm(attn.k_proj(x).view(1, 300, 2, 64))
        want_q, want_k = turn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        layer = ours.layers[0]
        qkv = torch.nn.functional.linear(x[0], layer["qkv"])
        got_q, got_k = ours.rotated_qk(layer, qkv, ours.cos[positions].unsqueeze(1),
                                       ours.sin[positions].unsqueeze(1))
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))


def test_an_olmo3_hub_config_reads_as_transformers_reads_it(tmp_path):
    """Olmo-3's config.json as the Hub ships it (rope_theta and a YaRN rope_scaling, which
    transformers gives the full-attention layers only; no layer_types: three windowed layers
    of four), and one left to Olmo3Config's defaults."""
    from transformers import Olmo3Config

    from pd_runtime.model.model_config import load_model_config

    hub = {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "hidden_size": 4096,
           "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
           "num_key_value_heads": 32, "max_position_embeddings": 65536, "rope_theta": 500000,
           "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32,
                            "beta_slow": 1, "original_max_position_embeddings": 8192,
                            "attention_factor": 1.2079441541679836},
           "sliding_window": 4096, "vocab_size": 100278, "rms_norm_eps": 1e-06}
    for raw in (hub, {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3"}):
        (tmp_path / "config.json").write_text(json.dumps(raw))
        ours = load_model_config(tmp_path)
        theirs = Olmo3Config(**{k: v for k, v in raw.items() if k != "architectures"})
        sliding = tuple(i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention")
        assert (ours.window_layers, ours.local_rope_layers, ours.sliding_window) == \
            (sliding, sliding, theirs.sliding_window)
        for rope, kind in ((ours.rope, "full_attention"), (ours.local_rope, "sliding_attention")):
            want = theirs.rope_parameters[kind]
            assert (rope.rope_type, rope.theta, rope.factor) == \
                (want["rope_type"], want["rope_theta"], want.get("factor", 1.0))
            if rope.rope_type == "yarn":
                assert (rope.attention_factor, rope.original_max_position_embeddings,
                        rope.beta_fast, rope.beta_slow) == \
                    (want["attention_factor"], want["original_max_position_embeddings"],
                     want["beta_fast"], want["beta_slow"])
        assert ours.rms_norm_eps == theirs.rms_norm_eps


@pytest.mark.parametrize("arch, raw", [
    ("Glm4ForCausalLM", {"attention_bias": True, "head_dim": 128, "hidden_size": 4096,
                         "intermediate_size": 13696, "num_attention_heads": 32,
                         "num_hidden_layers": 40, "num_key_value_heads": 2,
                         "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
                         "rope_theta": 10000.0, "vocab_size": 151552,
                         "max_position_embeddings": 32768}),  # GLM-4-9B-0414
    ("Cohere2ForCausalLM", {"hidden_size": 4096, "intermediate_size": 14336,
                            "num_attention_heads": 32, "num_hidden_layers": 32,
                            "num_key_value_heads": 8, "layer_norm_eps": 1e-05,
                            "logit_scale": 0.25, "rope_theta": 50000, "sliding_window": 4096,
                            "sliding_window_pattern": 4, "vocab_size": 256000}),  # R7B
    ("CohereForCausalLM", {"hidden_size": 12288, "intermediate_size": 33792,
                           "num_attention_heads": 96, "num_hidden_layers": 64,
                           "num_key_value_heads": 8, "layer_norm_eps": 1e-05,
                           "logit_scale": 0.8333333333333334, "rope_theta": 75000000.0,
                           "use_qk_norm": True, "vocab_size": 256000}),  # Command R+
])
def test_glm4_and_cohere_hub_configs_read_as_transformers_reads_them(tmp_path, arch, raw):
    """The Hub's files (top-level partial_rotary_factor and rope_theta, sliding_window_pattern
    without layer_types, layer_norm_eps, logit_scale, use_qk_norm) read as transformers'
    config classes read them."""
    import transformers

    from pd_runtime.model.model_config import load_model_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], **raw}))
    ours = load_model_config(tmp_path)
    theirs = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**raw)
    rope = theirs.rope_parameters
    assert (ours.rope.theta, ours.rope.partial_rotary_factor) == \
        (rope["rope_theta"], rope.get("partial_rotary_factor", 1.0))
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    eps = theirs.layer_norm_eps if hasattr(theirs, "layer_norm_eps") else theirs.rms_norm_eps
    assert (ours.rope.interleaved, ours.head_dim, ours.rms_norm_eps) == (True, head_dim, eps)
    if arch.startswith("Cohere"):
        assert (ours.logit_scale, ours.qk_norm, ours.tie_word_embeddings) == \
            (theirs.logit_scale, bool(getattr(theirs, "use_qk_norm", False)),
             theirs.tie_word_embeddings)
    if arch == "Cohere2ForCausalLM":
        sliding = tuple(i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention")
        assert (ours.window_layers, ours.sliding_window) == (sliding, theirs.sliding_window)
        assert set(ours.nope_layers) == set(range(theirs.num_hidden_layers)) - set(sliding)

