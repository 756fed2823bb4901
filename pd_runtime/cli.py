"""`pd-runtime` command line: serve, generate (offline), make-tiny-model, and the planner's
profile, simulate and plan (pd_runtime/planner/cli.py).

Settings come from flags and YAML here, at the edge; nothing deeper reads the environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from pd_runtime import serve_flags
from pd_runtime.default_model import ensure_default_model


def _cmd_make_tiny_model(args) -> int:
    from pd_runtime.model.tiny import make_tiny_model

    start = time.monotonic()
    out = make_tiny_model(args.path, preset=args.preset, architecture=args.architecture,
                          seed=args.seed)
    print(f"wrote {args.preset} {args.architecture} model to {out} "
          f"in {time.monotonic() - start:.1f}s")
    return 0


def _cmd_generate(args) -> int:
    from pd_runtime import LLM, SamplingParams

    model = serve_flags.model_dir(args) or str(ensure_default_model())
    llm = LLM(model, max_model_len=args.max_model_len)
    prompts = args.prompt or ["The prefill worker", "A decode worker streams tokens",
                              "Hello, my name is"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    start = time.monotonic()
    outputs = llm.generate(prompts, params)
    elapsed = time.monotonic() - start
    for prompt, out in zip(prompts, outputs):
        print(f"--- {prompt!r} -> {len(out.token_ids)} tokens ({out.finish_reason})")
        print(out.text)
    total = sum(len(o.token_ids) for o in outputs)
    print(f"{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s)")
    return 0


def _cmd_serve(args) -> int:
    from pd_runtime.config import ClusterConfig
    from pd_runtime.config_loading import load_cluster_config
    from pd_runtime.workers.launch import launch, run_demo

    cfg = serve_flags.apply(load_cluster_config(args.config) if args.config
                            else ClusterConfig(), args)
    model = serve_flags.model_dir(args) or cfg.model or str(ensure_default_model())
    if os.path.isdir(model):  # Ray's workers do not run in this working directory
        model = os.path.abspath(model)
    cfg = serve_flags.absolute_draft_models(cfg)
    if args.in_process and cfg.router.replicas > 1:
        raise SystemExit("pd-runtime: router.replicas > 1 needs the Ray pools (the replicas "
                         "are Ray actors over them); drop --in-process or set router.replicas: 1")
    if cfg.planner.autoscale.enabled and (args.in_process or cfg.router.replicas > 1):
        raise SystemExit("pd-runtime: planner.autoscale.enabled needs the Ray pools and one "
                         "router (it starts and drains Ray workers and keeps one view of the "
                         "pools); drop --in-process and set router.replicas: 1")
    if args.in_process:  # the same workers as threads of this process, KV over in-process links
        from pd_runtime.workers.local_pool import LocalPool

        cfg = cfg.model_copy(update={"kv_transfer": cfg.kv_transfer.model_copy(
            update={"backend": "local"})})
        client = LocalPool(cfg, model)
    else:
        client = launch(cfg, model, inside_job=bool(os.environ.get("RAY_ADDRESS")))
    close = getattr(client, "close", lambda: None)  # in-process workers end with this process
    if args.demo:  # a smoke test of the pools through both paths, then exit
        try:
            run_demo(client, args.prompt, args.max_tokens)
        finally:
            close()
        return 0
    from pd_runtime.workers.router_replicas import start_replicas
    from pd_runtime.entrypoints.openai.replicas import build_router
    from pd_runtime.entrypoints.openai.server import serve_http
    from pd_runtime.gateway.recorder import owner_name

    host = args.host or cfg.router.host
    port = cfg.router.port if args.port is None else args.port
    replicas = cfg.router.replicas
    backend, app = build_router(client, cfg, model, args.config, owner_name(host, port, 0))
    autoscaler = None
    if cfg.planner.autoscale.enabled:  # (refused with --in-process and replicas above)
        from pd_runtime.workers.elastic import Autoscaler

        autoscaler = Autoscaler(cfg, client, model, backend)
        backend.autoscale_status = autoscaler.status
        autoscaler.start()
    others = start_replicas(client, cfg, model, args.config, host, port,
                            getattr(args, "uvicorn_log_level", None) or "warning") \
        if replicas > 1 else []
    print(f"pd-runtime: serving {backend.model_name!r} at http://{host}:{port}/v1 "
          f"({len(client.prefill)} prefill, {len(client.decode)} decode workers"
          + (f", {replicas} router replicas" if replicas > 1 else "") + ")",
          file=sys.stderr, flush=True)
    try:
        serve_http(app, host, port, log_level=getattr(args, "uvicorn_log_level", None) or "info",
                   reuse_port=replicas > 1)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        print("pd-runtime: stopped", file=sys.stderr, flush=True)
    finally:
        if autoscaler is not None:
            autoscaler.stop()
        for replica in others:
            try:
                replica.stop.remote()
            except Exception:  # already gone: Ray ends it with the driver anyway
                pass
        backend.stop()
        close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-runtime", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny-model", help="write a deterministic random-weight model")
    tiny.add_argument("path")
    tiny.add_argument("--preset", choices=["bench", "test"], default="bench")
    tiny.add_argument("--architecture", default="llama",
                      choices=["llama", "mistral", "qwen2", "qwen3", "granite", "phi3",
                               "smollm3", "mixtral", "qwen3_moe", "qwen2_moe"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_make_tiny_model)

    for name, func, text in (("generate", _cmd_generate, "offline generation"),
                             ("serve", _cmd_serve, "the Ray pools behind the OpenAI HTTP router")):
        p = sub.add_parser(name, help=text)
        p.add_argument("model_path", nargs="?", metavar="MODEL",
                       help="HF model directory, as `vllm serve MODEL` takes it (or --model)")
        p.add_argument("--model", help="HF model directory (default: the embedded tiny model)")
        p.add_argument("--config", help="cluster YAML (serve); default: cluster_configs/local.yaml "
                                        "as built in")
        p.add_argument("--prompt", action="append", help="(serve: with --demo)")
        p.add_argument("--max-tokens", type=int, default=32, help="(serve: with --demo)")
        p.add_argument("--max-model-len", type=int, default=None,
                       help="(serve: engine.max_model_len, every pool)")
        p.add_argument("--seed", type=int, default=None,
                       help="(serve: engine.seed, every pool)")
        if name == "generate":
            p.add_argument("--temperature", type=float, default=0.0)
        if name == "serve":
            serve_flags.add_arguments(p)
            p.add_argument("--host", default=None, help="default: router.host from the config")
            p.add_argument("--port", type=int, default=None,
                           help="default: router.port from the config")
            p.add_argument("--demo", action="store_true",
                           help="run a few requests through both paths and exit")
            p.add_argument("--in-process", action="store_true",
                           help="no Ray: the config's workers run in this process (each on "
                                "its own thread and event loop, KV moved by in-process links)")
        p.set_defaults(func=func)

    from pd_runtime.planner.cli import add_commands

    add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pd-runtime: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
