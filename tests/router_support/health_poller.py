"""Polls GET /health from its own process (so that the test's threads cannot delay it) and
reports each poll's latency: `python health_poller.py PORT`, stopped by a line on stdin.

Prints "ready" once polling, then on stop one JSON list of [sent_at, latency_s] pairs, with
sent_at from time.monotonic() so that the test can tell which polls overlapped what.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time

INTERVAL_S = 0.01


def main(port: int) -> None:
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    polls = []
    announced = False
    while not stop.is_set():
        sent = time.monotonic()
        connection.request("GET", "/health")
        response = connection.getresponse()
        response.read()
        polls.append([sent, time.monotonic() - sent])
        if response.status != 200:
            raise SystemExit(f"/health answered {response.status}")
        if not announced:
            print("ready", flush=True)
            announced = True
        time.sleep(INTERVAL_S)
    print(json.dumps(polls), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
