"""Deterministic random-weight HF model directories: the bench model and the small test models.
Seeded weights plus a byte-level BPE trained on a built-in corpus, so every peer serves the same bytes."""

from __future__ import annotations

import copy
import json
import math
import os
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

PRESETS: dict[str, dict] = {
    # 31.8M parameters: the model every benchmark and peer comparison uses.
    "bench": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=8000, max_position_embeddings=4096, dtype="bfloat16"),
    # 0.14M parameters: small enough for unit tests to build in well under a second.
    "test": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048, dtype="float32"),
}

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"),
    "cohere": ("CohereConfig", "CohereForCausalLM"),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"),
}

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END, PAD]  # ids 0..4, in this order
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Logit std across the vocabulary: the final RMSNorm fixes |h| = sqrt(hidden), so an lm_head
# entry std of LOGIT_STD / sqrt(hidden) gives this spread for every input. At 4 the top token
# leads the runner-up by ~1 logit on average, so greedy output is decisive, not a coin toss.
LOGIT_STD = 4.0
NORM_NOISE = 0.05  # RMSNorm weights are 1 + noise, so a kernel that drops the weight is caught
BIAS_STD = 0.1
_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def make_tiny_model(path: str | os.PathLike, preset: str = "test", architecture: str = "llama",
                    dtype: str | None = None, seed: int = 0, tokenizer_vocab_size: int | None = None,
                    quantization: str | None = None, **overrides) -> Path:
    """Write a complete HF model directory at `path` and return it.

    `overrides` set config fields (`num_hidden_layers=3`, `tie_word_embeddings=True`,
    `rope_scaling={...}`, a `vocab_size` above the tokenizer's to mimic a padded vocabulary).
    The tokenizer has `tokenizer_vocab_size` tokens: by default the preset's vocabulary, or the
    config's if that is smaller. `quantization="mxfp4"` (gpt_oss only) stores the experts as
    OpenAI's checkpoints do. Same arguments -> byte-identical files.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}, "
                         f"got {architecture!r}")
    fields = copy.deepcopy({**PRESETS[preset], **overrides})  # transformers edits rope dicts in place
    if dtype is not None:
        fields["dtype"] = dtype
    if tokenizer_vocab_size is None:
        tokenizer_vocab_size = min(PRESETS[preset]["vocab_size"], fields["vocab_size"])
    if quantization not in (None, "mxfp4") or (quantization and architecture != "gpt_oss"):
        raise ValueError(f"quantization {quantization!r}: only 'mxfp4', for gpt_oss")
    if tokenizer_vocab_size > fields["vocab_size"]:
        raise ValueError(f"tokenizer_vocab_size {tokenizer_vocab_size} exceeds "
                         f"vocab_size {fields['vocab_size']}")

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = _build_config(architecture, fields)
    if quantization:  # (the experts; attention, router and embeddings stay as they are)
        config.quantization_config = {"quant_method": quantization, "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    _write_weights(out / "model.safetensors", config, seed, tokenizer_vocab_size)
    _write_config(out, config)
    _write_tokenizer(out, tokenizer_vocab_size, config.max_position_embeddings)
    return out


def _build_config(architecture: str, fields: dict):
    import transformers

    config_name, model_name = ARCHITECTURES[architecture]
    if architecture in ("qwen3", "qwen3_moe") and "head_dim" not in fields:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if architecture in ("qwen3_moe", "qwen2_moe"):  # small experts, a handful (Qwen3's: 128)
        fields.setdefault("num_experts", 8)
        fields.setdefault("moe_intermediate_size", fields["intermediate_size"] // 4)
    if architecture == "olmoe":  # 8 experts of the preset's size, 2 a token (OLMoE's: 64, 8)
        fields.setdefault("num_experts", 8)
        fields.setdefault("num_experts_per_tok", 2)
    if architecture == "qwen2_moe":
        fields.setdefault("shared_expert_intermediate_size", fields["intermediate_size"] // 2)
        fields.setdefault("use_sliding_window", False)
    if architecture == "qwen2":
        fields.setdefault("use_sliding_window", False)
    if architecture == "mistral":
        fields.setdefault("sliding_window", None)  # full attention, as in Mistral v0.2+
    if architecture in ("gemma", "gemma2", "gemma3", "gpt_oss", "glm4"):  # (theirs: 256, 64, 128)
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    if architecture == "gpt_oss":  # 8 experts; YaRN (as gpt-oss's own) up to the preset's context
        fields.setdefault("num_local_experts", 8)
        fields.setdefault("rope_parameters", {
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": fields["max_position_embeddings"] // 8})
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    config = getattr(transformers, config_name)(
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD], **fields)
    config.architectures = [model_name]
    return config


def _write_weights(file: Path, config, seed: int, tokenizer_vocab_size: int) -> None:
    import transformers

    # The meta model only supplies names and shapes; values never depend on transformers' init.
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    dtype = getattr(torch, str(config.dtype).removeprefix("torch."))
    logit_scale = LOGIT_STD / math.sqrt(config.hidden_size)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        shape = shapes[name]
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):  # (Gemma's are offsets from 1)
            value = NORM_NOISE * noise if config.architectures[0].startswith("Gemma") \
                else 1.0 + NORM_NOISE * noise
        elif name.endswith((".bias", "_bias")):
            value = BIAS_STD * noise
        elif name.endswith("self_attn.sinks"):  # about the scores' size: a share of each row
            value = noise
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")) \
                and config.architectures[0] == "GptOssForCausalLM":  # (x @ W: rows are inputs)
            value = noise / math.sqrt(shape[-2])
        elif name.endswith("embed_tokens.weight") and not config.tie_word_embeddings:
            value = noise  # unit-RMS residual stream from the first layer on
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            value = logit_scale * noise
        else:
            value = noise / math.sqrt(shape[-1])  # variance-preserving for x @ W.T
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            # Padding rows score exactly 0, far below the top logit, so greedy decoding never
            # emits an id the tokenizer cannot decode (as with real padded checkpoints).
            value[tokenizer_vocab_size:] = 0.0
        tensors[name] = value.to(dtype).contiguous()
    if getattr(config, "quantization_config", None):
        tensors = _mxfp4_experts(tensors)
    save_file(_hub_experts(tensors, config), str(file), metadata={"format": "pt"})


def _mxfp4_experts(tensors: dict) -> dict:
    """gpt-oss's stacked experts as MXFP4 blocks and scales (model/gpt_oss.py), rows in a
    linear weight's layout, each group of 32 scaled so its largest value fits e2m1's 6."""
    out = {}
    for name, value in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = value
            continue
        rows = value.float().transpose(1, 2)  # [experts, out, in]
        groups = rows.reshape(*rows.shape[:2], -1, 32)
        top = groups.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
        exponent = (torch.floor(torch.log2(top)) - 2).clamp(-127, 127)
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        scaled = (groups / torch.exp2(exponent)).clamp(-6.0, 6.0)
        code = (scaled.abs()[..., None] - grid).abs().argmin(-1) + 8 * (scaled < 0)
        code = code.to(torch.uint8).reshape(*groups.shape[:3], 16, 2)
        out[name + "_blocks"] = (code[..., 0] | (code[..., 1] << 4)).contiguous()
        out[name + "_scales"] = (exponent[..., 0] + 127).to(torch.uint8).contiguous()
    return out


def _hub_experts(tensors: dict, config) -> dict:
    """transformers 5 holds a layer's experts stacked (experts.gate_up_proj, experts.down_proj);
    checkpoints on the Hub, and its own save_pretrained, hold them one by one under the
    family's names: those are written."""
    names = {"MixtralForCausalLM": ("block_sparse_moe.", "w1", "w3", "w2"),
             "Qwen3MoeForCausalLM": ("mlp.", "gate_proj", "up_proj", "down_proj"),
             "Qwen2MoeForCausalLM": ("mlp.", "gate_proj", "up_proj", "down_proj"),
             "OlmoeForCausalLM": ("mlp.", "gate_proj", "up_proj", "down_proj")}
    if config.architectures[0] == "GraniteMoeForCausalLM":  # stacked, under older names
        renamed = {"experts.gate_up_proj": "input_linear.weight",
                   "experts.down_proj": "output_linear.weight",
                   "router.weight": "router.layer.weight"}
        out = {}
        for name, value in tensors.items():
            head, _, rest = name.partition("block_sparse_moe.")
            out[head + "block_sparse_moe." + renamed[rest] if rest else name] = value
        return out
    if config.architectures[0] not in names:
        return tensors
    block, gate_name, up_name, down_name = names[config.architectures[0]]
    out = {}
    for name, value in tensors.items():
        prefix, _, rest = name.partition("mlp.")
        if rest == "gate.weight":
            out[prefix + block + rest] = value
        elif rest == "experts.gate_up_proj":
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                out[f"{prefix}{block}experts.{e}.{gate_name}.weight"] = gate[e].contiguous()
                out[f"{prefix}{block}experts.{e}.{up_name}.weight"] = up[e].contiguous()
        elif rest == "experts.down_proj":
            for e in range(value.shape[0]):
                out[f"{prefix}{block}experts.{e}.{down_name}.weight"] = value[e].contiguous()
        else:
            out[name] = value
    return out


def _write_config(out: Path, config) -> None:
    from transformers import GenerationConfig

    config.save_pretrained(out)
    # Readers on transformers 4.x (some peers) know only rope_theta / rope_scaling; transformers 5
    # prefers rope_parameters when both are present, so the legacy keys are pure additions.
    raw = json.loads((out / "config.json").read_text())
    rope = dict(raw.get("rope_parameters") or {})
    if "rope_theta" in rope:
        raw["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type", "default") != "default":
            raw["rope_scaling"] = rope
        (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    GenerationConfig(bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[IM_END]],
                     pad_token_id=ids[PAD]).save_pretrained(out)


def _write_tokenizer(out: Path, vocab_size: int, model_max_length: int) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    # Qwen2's pre-tokenization (Llama-3-like regex, single digits): transformers 5 rebuilds a
    # qwen2 directory's tokenizer with exactly this pipeline, so every architecture agrees.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus(vocab_size), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer trained to {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    # Like Llama: encode(text) prepends bos; chat prompts are rendered without it.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, 0)])
    tokenizer.save(str(out / "tokenizer.json"))

    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "unk_token": None,  # byte-level BPE needs none; Qwen2Tokenizer would otherwise add one
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "extra_special_tokens": [IM_START, IM_END],
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
                                 for i, t in enumerate(SPECIAL_TOKENS)},
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", {**special, "additional_special_tokens": [IM_START, IM_END]})


def _write_json(file: Path, obj: dict) -> None:
    file.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


_WORDS = (
    "the of and to in is was for on that with as by at from it this be are an or have not which "
    "one had but all were they their there been has more when will would who so no time if out up "
    "about into than them can only other new some could these two may first then do any like my now "
    "over such our man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very "
    "make world still own see men work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right used take "
    "three model token server request prefill decode cache block memory queue worker latency python"
).split()
_FOREIGN = ("café naïve façade über straße señor niño déjà vu crème brûlée smörgåsbord Ærø "
            "你好 世界 日本語 東京 한국어 서울 Привет мир Ελληνικά مرحبا नमस्ते").split()
_EMOJI = "🙂 🚀 🎉 👍 🔥 ❤️ 🤖 🌍 ✨ 😂 👩‍💻 🇫🇷".split()
_PUNCT = [".", ",", "!", "?", ";", ":", " -", "'s", "\"", ")", "...", "%", "$"]


def _corpus(vocab_size: int) -> list[str]:
    """Deterministic English-like lines with digits, punctuation, code and multi-byte text.

    Pseudo-words from syllables give BPE enough distinct pairs to reach vocabularies past 20k;
    the line count grows with the vocabulary so the small preset stays fast to train.
    """
    rng = random.Random(20240607)
    onsets = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl pr sh st th tr".split()
    vowels = "a e i o u ai ea ee ie oo ou".split()
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "st", "ck", "ng", "rm"]
    coined = sorted({"".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                             for _ in range(rng.randint(1, 3))) for _ in range(vocab_size)})
    lexicon = _WORDS * 4 + coined  # common words stay the most frequent, as in real text
    lines = []
    for i in range(vocab_size // 2 + 200):
        kind = i % 10
        if kind == 7:
            lines.append(f"{rng.randint(1, 31):02d}/{rng.randint(1, 12):02d}/{rng.randint(1900, 2099)} "
                         f"{rng.randint(0, 99999)} {rng.random() * 1000:.2f} x{rng.randint(0, 255):02x}")
            continue
        if kind == 8:
            a, b = rng.choice(coined)[:8], rng.choice(coined)[:8]
            lines.append(f"def {a}_{b}(x, n={rng.randint(0, 9)}):\n"
                         f"    return [{a}(i) for i in range(n)]  # {b}\n")
            continue
        words = [rng.choice(lexicon) for _ in range(rng.randint(4, 16))]
        if kind == 9:
            words += [rng.choice(_FOREIGN) for _ in range(3)] + [rng.choice(_EMOJI)]
            rng.shuffle(words)
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice(_PUNCT) + (" " + rng.choice(_EMOJI) if kind == 3 else ""))
    return lines
