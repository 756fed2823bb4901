"""Model directories as users bring them: errors, sharding, padded vocab; text that streams."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pd_runtime import LLM, SamplingParams
from pd_runtime.engine.detokenizer import detokenize_step
from pd_runtime.engine.sequence import Request
from pd_runtime.model.loader import load_model
from pd_runtime.model.model_config import ModelLoadError
from pd_runtime.tokenizer import Tokenizer


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_names_file(llama_dir, tmp_path):
    path = copy_model(llama_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config.json.*GPT2LMHeadModel"):
        load_model(path)


def test_quantized_checkpoint_refused_by_name(llama_dir, tmp_path):
    """FP8/AWQ/GPTQ weights would load as numbers without their scales: wrong text, silently."""
    path = copy_model(llama_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config.json: quantized .*'fp8'"):
        LLM(str(path))


def test_another_activation_refused_by_name(llama_dir, tmp_path):
    """The MLP is SiLU's here: a checkpoint with another activation would run, wrongly."""
    path = copy_model(llama_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config.json: hidden_act 'gelu'"):
        load_model(path)


@pytest.mark.parametrize("family, rope, says", [
    # Partial rotation and LongRoPE are Phi-3's (transformers turns every dimension elsewhere).
    ("llama", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75},
     "partial_rotary_factor 0.75 is not supported for llama"),
    ("llama", {"rope_type": "longrope", "rope_theta": 1e4, "long_factor": [1.0] * 8,
               "short_factor": [1.0] * 8}, "rope type 'longrope' is not supported"),
    ("phi3", {"rope_type": "longrope", "rope_theta": 1e4, "long_factor": [1.0] * 8,
              "short_factor": [1.0] * 7}, "longrope's short_factor must be 8 positive"),
    ("phi3", {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
              "long_factor": [1.0] * 8, "short_factor": [1.0] * 8},
     "longrope's short_factor must be 4 positive"),
    ("phi3", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
     "rope type 'dynamic' is not supported"),
    ("phi3", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
     "rope type 'linear' is not supported for phi3"),
])
def test_a_rope_the_decoder_lacks_is_refused_by_name(model_factory, tmp_path, family, rope,
                                                      says):
    """A rope variant read as another would load and run wrongly: refused, naming it."""
    path = copy_model(model_factory(family), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = rope
    cfg.pop("rope_scaling", None)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=f"config.json: {says}"):
        load_model(path)


def test_longrope_picks_its_factors_by_the_served_context(model_factory, tmp_path):
    """Phi-3.5-mini's 128k context: LongRoPE's long factors for every position when the served
    context (max_model_len) passes original_max_position_embeddings, the short ones when it
    does not (as vLLM decides); the choice is part of the model's identity, so KV turned one
    way is never handed to the other (tests/test_model_vs_transformers.py: both exact)."""
    from pd_runtime.model.model_config import context_limit, load_model_config, served

    path = copy_model(model_factory("phi3"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(max_position_embeddings=8192, original_max_position_embeddings=256,
               rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                "long_factor": [2.0] * 8, "short_factor": [1.0] * 8})
    (path / "config.json").write_text(json.dumps(cfg))
    model = load_model_config(path)
    assert (model.rope.rope_type, model.rope.factor) == ("longrope", 32.0)
    assert context_limit(model, None) == 8192 and context_limit(model, 300) == 300
    assert not served(model, 256).rope.long and served(model, 257).rope.long
    assert served(model, 256).identity == model.identity != served(model, 257).identity
    full = LLM(str(path), num_kv_blocks=64).engine
    within = LLM(str(path), num_kv_blocks=64, max_model_len=256).engine
    assert (full.max_model_len, full.model_config.rope.long) == (8192, True)
    assert (within.max_model_len, within.model_config.rope.long) == (256, False)
    # Phi3Config reads "su" and "yarn" as longrope, and a missing original length as 4096.
    for name in ("su", "yarn"):
        cfg["rope_parameters"]["rope_type"] = name
        (path / "config.json").write_text(json.dumps(cfg))
        assert load_model_config(path).rope == model.rope
    del cfg["original_max_position_embeddings"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(path).rope.original_max_position_embeddings == 4096


def test_a_tensor_no_config_field_accounts_for_is_refused(llama_dir, tmp_path):
    """An o_proj bias in a checkpoint whose config says no attention_bias: served without it,
    the output would be wrong with no error; a rotary table or a tied model's lm_head is fine."""

    path = copy_model(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    hidden = tensors["model.norm.weight"].shape[0]
    extra = {**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}
    save_file(extra, path / "model.safetensors")
    load_model(path)
    extra["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(hidden)
    save_file(extra, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"does not account for: "
                                             r"model\.layers\.1\.self_attn\.o_proj\.bias"):
        load_model(path)


def test_missing_files_named(llama_dir, tmp_path):
    path = copy_model(llama_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(path)
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path / "nowhere")


def test_shape_mismatch_and_missing_tensor_named(llama_dir, tmp_path):
    path = copy_model(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.safetensors.*down_proj.*shape"):
        load_model(path)
    del tensors[name]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="down_proj.weight.*missing"):
        load_model(path)


def test_sharded_checkpoint_loads_identically(llama_dir, tmp_path):
    path = copy_model(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / fname)
        weight_map.update({k: fname for k in keys})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompt = [[5, 9, 33, 70]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a = LLM(llama_dir, dtype="float32", num_kv_blocks=32).generate(prompt, params)[0].token_ids
    b = LLM(str(path), dtype="float32", num_kv_blocks=32).generate(prompt, params)[0].token_ids
    assert a == b


def test_pytorch_bin_checkpoints_load_identically(llama_dir, tmp_path):
    """Older checkpoints ship pickled PyTorch weights: one pytorch_model.bin, or shards with
    their index (and a training_args.bin beside them, which is not weights)."""
    import torch

    tensors = load_file(f"{llama_dir}/model.safetensors")
    single = copy_model(llama_dir, tmp_path / "single")
    (single / "model.safetensors").unlink()
    torch.save(tensors, single / "pytorch_model.bin")
    (single / "training_args.bin").write_bytes(b"not a state dict")
    sharded = copy_model(llama_dir, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, keys in enumerate((names[::2], names[1::2])):
        fname = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: tensors[k] for k in keys}, sharded / fname)
        weight_map.update({k: fname for k in keys})
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompt = [[5, 9, 33, 70]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = LLM(llama_dir, dtype="float32", num_kv_blocks=32).generate(prompt, params)[0].token_ids
    for path in (single, sharded):
        assert LLM(str(path), dtype="float32", num_kv_blocks=32).generate(
            prompt, params)[0].token_ids == want
    # A pickle that is not plain tensors is refused, not run.
    (single / "pytorch_model.bin").write_bytes(b"\x80\x04cos\nsystem\n.")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin.*weights_only"):
        load_model(single)


def test_padded_vocab_generates_and_decodes(model_factory):
    # Embedding rows beyond the tokenizer (as in Qwen): sampling may pick them.
    path = model_factory("qwen2", vocab_size=640, tokenizer_vocab_size=512)
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    assert llm.tokenizer.vocab_size == 512 and llm.engine.model_config.vocab_size == 640
    outs = llm.generate(["hello there"] * 4,
                        SamplingParams(max_tokens=40, temperature=5.0, seed=1, ignore_eos=True))
    ids = [t for o in outs for t in o.token_ids]
    assert any(t >= 512 for t in ids), "high temperature should reach the padded rows"
    assert all(isinstance(o.text, str) for o in outs)
    assert llm.tokenizer.decode([600, 601]) == ""


def test_incremental_text_never_splits_characters(llama_dir):
    tok = Tokenizer(llama_dir)
    text = "naïve café 日本語テキスト 🙂🚀 ünïcödé ∑∫ done"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    req = Request("r", [1], SamplingParams())
    deltas = []
    for t in ids:
        req.output_token_ids.append(t)
        deltas.append(detokenize_step(tok, req))
    deltas.append(detokenize_step(tok, req, flush=True))
    assert "".join(deltas) == text == req.text
    assert all("\ufffd" not in d for d in deltas)
    # The text must really contain characters split across tokens, or this proves nothing.
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))


def test_chat_template_and_eos(llama_dir):
    tok = Tokenizer(llama_dir)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi" in rendered
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.encode("<|im_start|>", add_special_tokens=False)[0]
    assert len(tok.eos_token_ids) >= 1


def test_cli_make_tiny_model_and_generate(tmp_path):
    out = tmp_path / "tiny"
    run = subprocess.run([sys.executable, "-m", "pd_runtime.cli", "make-tiny-model", str(out),
                          "--preset", "test"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    run = subprocess.run([sys.executable, "-m", "pd_runtime.cli", "generate", "--model",
                          str(out), "--prompt", "hello", "--max-tokens", "5"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "5 tokens" in run.stdout
    run = subprocess.run([sys.executable, "-m", "pd_runtime.cli", "generate", "--model",
                          str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "config.json" in run.stderr
