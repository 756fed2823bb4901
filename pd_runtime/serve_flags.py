"""`pd-runtime serve`'s flags that say what `vllm serve`'s say (a model as the first argument,
--served-model-name, --api-key, --chat-template, --tool-call-parser, --max-model-len, ...),
applied to the cluster config over what its YAML holds, and validated with it.

The engine flags set every pool's engine (prefill, decode, colocated); a flag's value wins over
the file's. Names vLLM gives its tool-call and reasoning parsers are taken for ours.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from typing import Optional

from pydantic import ValidationError

log = logging.getLogger(__name__)

# vLLM's parser names -> ours (router.tool_call_parser, router.reasoning_parser).
TOOL_CALL_PARSERS = {"auto": "auto", "none": "none", "hermes": "hermes", "mistral": "mistral",
                     "llama3_json": "llama3_json", "llama4_json": "llama3_json",
                     "pythonic": "pythonic", "llama4_pythonic": "pythonic",
                     "deepseek_v3": "deepseek_v3", "deepseek_v31": "deepseek_v3",
                     "qwen3_coder": "qwen3_coder", "qwen3_xml": "qwen3_coder",
                     "granite": "granite", "harmony": "harmony", "openai": "harmony"}
REASONING_PARSERS = {"auto": "auto", "none": "none", "think": "think",
                     "deepseek_r1": "think", "qwen3": "think", "harmony": "harmony",
                     "openai_gptoss": "harmony"}
_DTYPES = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
           "float16": "float16", "half": "float16"}
# flag (argparse dest) -> the engine field it sets in every pool
_ENGINE = {"max_model_len": "max_model_len", "dtype": "dtype", "seed": "seed",
           "enable_prefix_caching": "enable_prefix_caching", "max_num_seqs": "max_num_seqs",
           "max_num_batched_tokens": "max_num_batched_tokens", "block_size": "block_size",
           "kv_cache_dtype": "kv_cache_dtype", "gpu_memory_utilization": "gpu_memory_utilization",
           "swap_space": "swap_space_bytes", "tensor_parallel_size": "tensor_parallel_size",
           "kv_offloading_size": "kv_offloading_size"}
GIB = 1 << 30
_ROUTER = {"served_model_name": "served_model_name", "chat_template": "chat_template",
           "tool_call_parser": "tool_call_parser", "reasoning_parser": "reasoning_parser",
           "generation_config": "sampling_defaults"}
_NAMES = {"tool_call_parser": TOOL_CALL_PARSERS, "reasoning_parser": REASONING_PARSERS,
          "generation_config": {"auto": "model", "vllm": "openai"}}
_POOLS = ("prefill", "decode", "colocated")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags, on `serve`'s parser (the model, --max-model-len and --seed are added by the
    caller: `generate` takes them too)."""
    parser.add_argument("--served-model-name", nargs="+",
                        help="router.served_model_name (one; without it, a model given first "
                             "is served under that name as given, as vLLM names it)")
    parser.add_argument("--api-key", nargs="+",
                        help="API keys, any of which a request must send (router.tenants: "
                             "`default`, `default-2`, ..., sharing the prefix cache)")
    parser.add_argument("--chat-template", help="router.chat_template: a Jinja file, or the "
                                                "template itself")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS),
                        help="router.tool_call_parser (vLLM's names are taken too)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command lines: tool_choice auto is on "
                             "whenever the tool-call format is known")
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                        help="router.reasoning_parser (vLLM's deepseek_r1 and qwen3: think)")
    parser.add_argument("--generation-config", choices=("auto", "vllm"),
                        help="auto: the model's generation_config.json sampling defaults "
                             "(router.sampling_defaults: model); vllm: OpenAI's (openai)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="engine.dtype, every pool")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=None, help="engine.enable_prefix_caching, every pool")
    parser.add_argument("--max-num-seqs", type=int, help="engine.max_num_seqs, every pool")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="engine.max_num_batched_tokens, every pool")
    parser.add_argument("--block-size", type=int, help="engine.block_size, every pool")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8"),
                        help="engine.kv_cache_dtype, every pool")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="engine.gpu_memory_utilization, every pool: the share of its GPU's "
                             "memory an engine takes, its KV cache what the rest leaves (CUDA "
                             "only; engines sharing a GPU need a share each)")
    parser.add_argument("--swap-space", type=float, metavar="GIB",
                        help="engine.swap_space_bytes in GiB, every pool (host memory for "
                             "sequences preempted with preemption_mode: swap)")
    parser.add_argument("--kv-offloading-size", type=float, metavar="GIB",
                        help="engine.kv_offloading_size, every pool: GiB of host memory that "
                             "evicted prefix-cache blocks move to (and are loaded back from)")
    parser.add_argument("--disable-log-requests", "--disable-uvicorn-access-log",
                        dest="disable_log_requests", action="store_true", default=None,
                        help="router.log_requests: false (no line per request)")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        parser.add_argument(flag, type=_json_list, metavar="JSON",
                            help=f"router.cors.{flag[2:].replace('-', '_')}: the {what} "
                                 "browsers' cross-origin requests may use, a JSON list as "
                                 "vLLM takes it (default [\"*\"])")
    parser.add_argument("--allow-credentials", action="store_true", default=None,
                        help="router.cors.allow_credentials: true")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="accepted for vLLM's command lines: no stats are logged "
                             "periodically here (they are at /metrics)")
    parser.add_argument("--uvicorn-log-level",
                        choices=("critical", "error", "warning", "info", "debug", "trace"),
                        help="the HTTP servers' own log level (default: info; router "
                             "replicas beyond the first: warning)")
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="engine.cuda_graphs: false, every pool")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                        help="engine.tensor_parallel_size, every pool: ranks per worker")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM's command lines: no model code is ever run "
                             "from the model directory here")


def model_dir(args: argparse.Namespace) -> Optional[str]:
    """The model named on the command line (first argument or --model), or None."""
    positional = getattr(args, "model_path", None)
    if positional and args.model and positional != args.model:
        raise ValueError(f"the model is given twice: {positional!r} and --model {args.model!r}")
    return positional or args.model


def apply(cfg, args: argparse.Namespace):
    """`cfg` (a ClusterConfig) with the flags given applied, validated anew; an invalid value
    is a ValueError naming its flag."""
    data = cfg.model_dump()
    set_fields: dict[str, str] = {}  # field -> the flag that set it
    if getattr(args, "enforce_eager", None):
        for pool in _POOLS:
            data[pool]["engine"]["cuda_graphs"] = False
        set_fields["cuda_graphs"] = "--enforce-eager"
    for dest, field in _ENGINE.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest == "dtype":
            value = _DTYPES[value]
        elif dest == "swap_space":
            value = gib_bytes("--swap-space", value)
        for pool in _POOLS:
            data[pool]["engine"][field] = value
        set_fields[field] = _flag(dest)
    if (getattr(args, "tensor_parallel_size", None) or 1) > 1 and getattr(args, "in_process",
                                                                             False) \
            and not getattr(args, "config", None):
        # In one process the workers' KV moves over in-process links, which cannot reach a
        # tensor-parallel worker's other ranks: the default deployment serves colocated there.
        data["prefill"]["num_workers"] = 0
        log.info("--tensor-parallel-size %d --in-process: the default deployment serves "
                 "colocated (no prefill pool)", args.tensor_parallel_size)
    names = getattr(args, "served_model_name", None)
    if names is not None and len(names) > 1:
        raise ValueError(f"--served-model-name: one name is served here, got {len(names)}")
    for dest, field in _ROUTER.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest == "served_model_name":
            value = value[0]
        value = _NAMES[dest][value] if dest in _NAMES else value
        data["router"][field] = value
        set_fields[field] = _flag(dest)
    for dest in ("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials"):
        value = getattr(args, dest, None)
        if value is not None:
            data["router"]["cors"][dest] = value
            set_fields[dest] = _flag(dest)
    if getattr(args, "disable_log_requests", None):
        data["router"]["log_requests"] = False
        set_fields["log_requests"] = "--disable-log-requests"
    given = getattr(args, "model_path", None)
    if given and names is None and not data["router"]["served_model_name"]:
        data["router"]["served_model_name"] = given  # vLLM serves a model under its argument
        set_fields["served_model_name"] = "MODEL"
    if getattr(args, "api_key", None) is not None:
        if data["router"]["tenants"]:
            raise ValueError("--api-key: the config already names its tenants (router.tenants); "
                             "give the keys there")
        data["router"]["tenants"] = [
            {"tenant_id": "default" if i == 0 else f"default-{i + 1}", "api_key": key,
             "share_prefix_cache": True} for i, key in enumerate(args.api_key)]
        set_fields["api_key"] = "--api-key"
    if not set_fields:
        return cfg
    try:
        return type(cfg).model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = next((str(part) for part in reversed(error["loc"]) if str(part) in set_fields),
                     None)
        where = set_fields[field] if field else ".".join(map(str, error["loc"]))
        raise ValueError(f"{where}: {error['msg']}") from None


def engine_fields(model: str, args: dict) -> dict:
    """`LLM(model, **args)`'s arguments as EngineConfig's fields: vLLM's names for what they
    share are taken (enforce_eager, swap_space in GiB, a dtype alias or torch dtype), those
    with nothing to set here accepted when they ask for what happens anyway
    (trust_remote_code, disable_log_stats, enable_chunked_prefill
    true, the model's own tokenizer); anything else is left for EngineConfig to refuse by
    name."""
    out = dict(args)
    tokenizer = out.pop("tokenizer", None)
    if tokenizer is not None and os.path.realpath(os.fspath(tokenizer)) != \
            os.path.realpath(model):
        raise ValueError(f"tokenizer: {tokenizer!r}; the model directory's own tokenizer is "
                         "the one used")
    if out.get("enable_chunked_prefill", True) is not True:
        raise ValueError("enable_chunked_prefill: prompts are always chunked to "
                         "max_num_batched_tokens here")
    for name in ("trust_remote_code", "disable_log_stats", "enable_chunked_prefill"):
        out.pop(name, None)
    if "enforce_eager" in out:
        out["cuda_graphs"] = not out.pop("enforce_eager")
    if "swap_space" in out:
        out["swap_space_bytes"] = gib_bytes("swap_space", out.pop("swap_space"))
    dtype = out.get("dtype")
    if dtype is not None and not isinstance(dtype, str):  # torch.bfloat16, say
        dtype = str(dtype).removeprefix("torch.")
    if dtype is not None:
        out["dtype"] = _DTYPES.get(dtype, dtype)
    return out


def gib_bytes(name: str, gib) -> int:
    """vLLM's sizes in GiB (--swap-space) as bytes; a ValueError naming `name` for a value
    that is not a finite size."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib) \
            or gib < 0:
        raise ValueError(f"{name}: {gib!r} GiB is not a size")
    return int(gib * GIB)


def _json_list(text: str) -> list:
    """A flag's value as vLLM reads --allowed-origins: a JSON list of strings."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"a JSON list of strings, got {text!r}")
    return value


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def absolute_draft_models(cfg):
    """`cfg` with each pool's speculative_model directory made absolute (the workers do not run
    in this working directory)."""
    update = {}
    for pool in _POOLS:
        engine = getattr(cfg, pool).engine
        draft = engine.speculative_model
        if draft and os.path.isdir(draft) and not os.path.isabs(draft):
            update[pool] = getattr(cfg, pool).model_copy(update={"engine": engine.model_copy(
                update={"speculative_model": os.path.abspath(draft)})})
    return cfg.model_copy(update=update) if update else cfg
