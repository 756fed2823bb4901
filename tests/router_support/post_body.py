"""POSTs a file's bytes from its own process (so that sending megabytes holds none of the test's
GIL): `python post_body.py PORT PATH FILE`. It reads the file, prints "ready", sends when a line
arrives on stdin, then prints the status line and the response body.
"""

from __future__ import annotations

import http.client
import sys


def main(port: int, path: str, body_file: str) -> None:
    with open(body_file, "rb") as file:
        body = file.read()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    print("ready", flush=True)
    sys.stdin.readline()  # started and loaded before the test's clock runs
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    print(response.status)
    print(response.read().decode())


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
