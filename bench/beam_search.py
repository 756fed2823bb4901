"""What beam search costs a client: `pd-runtime serve` with no flags but the port (the embedded
model, 1 prefill + 1 decode worker, SLO routing), a completion of --max-tokens tokens from a
random --prompt-len token prompt with `use_beam_search` and n beams, against the same request
sampled with n choices in the same run (the peer: n independent decodes), alternated.

    .venv/bin/python bench/beam_search.py [--widths 2 4] [--max-tokens 32] [--repeats 3]

Run inside `unshare -n` with loopback up (Ray then binds 127.0.0.1).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import goodput_study as study  # noqa: E402
from bench.common import machine_line  # noqa: E402


class Server(study.Server):
    """goodput_study's server (readiness, stop), started with no flags but the port."""

    def __init__(self, out: Path, port: int):
        self.name, self.port = "pd-default", port
        self.log = open(out / "server.log", "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen([str(ROOT / ".venv/bin/pd-runtime"), "serve", "--port",
                                      str(port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True)


def timed(base: str, body: dict) -> float:
    start = time.perf_counter()
    resp = httpx.post(base + "/v1/completions", json=body, timeout=600)
    resp.raise_for_status()
    assert len(resp.json()["choices"]) == body["n"]
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()
    server = Server(Path(tempfile.mkdtemp()), args.port)
    try:
        server.wait_ready()
        model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        rng = random.Random(0)
        print(machine_line())
        print(f"prompt {args.prompt_len} tokens, {args.max_tokens} out, median of "
              f"{args.repeats}, a fresh prompt each repeat")
        for width in args.widths:
            times: dict[str, list[float]] = {"sampled": [], "beam": []}
            for _ in range(args.repeats):
                prompt = [rng.randrange(5, 7000) for _ in range(args.prompt_len)]
                base = {"model": model, "prompt": prompt, "n": width, "ignore_eos": True,
                        "max_tokens": args.max_tokens}
                times["sampled"].append(timed(server.base_url, {**base, "temperature": 1.0,
                                                                "seed": 1}))
                times["beam"].append(timed(server.base_url, {**base, "use_beam_search": True}))
            sampled, beam = (statistics.median(times[k]) for k in ("sampled", "beam"))
            print(f"n={width}: sampled {sampled:.2f} s, beam search {beam:.2f} s, "
                  f"ratio {beam / sampled:.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
