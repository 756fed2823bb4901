"""The second process of kv_transfer's two-process tests: one agent driven by commands over a
pipe (spawned with multiprocessing, so it is a real separate process with its own transport).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import torch

from tests.kv_transfer_support.common import fill_random, transport_and_caches


def _serve(conn, backend, overrides, engine_id, num_layers):
    from pd_runtime.kv_transfer.base import LinkState
    from pd_runtime.kv_transfer.registry import create_agent

    cfg, transport, big, caches = transport_and_caches(backend, overrides, num_layers)
    agent = create_agent(cfg, caches, engine_id=engine_id, model_id="m", transport=transport,
                         heartbeat_interval_s=0.2, peer_timeout_s=2.0)
    conn.send(agent.metadata())
    while True:
        command, args = conn.recv()
        try:
            if command == "connect":
                peer = agent.connect(args[0])
                deadline = time.monotonic() + 10
                while agent.peer_state(peer)[0] is LinkState.CONNECTING and time.monotonic() < deadline:
                    time.sleep(0.01)
                result = agent.peer_state(peer)[0].value
            elif command == "fill":
                fill_random(caches, args[0], args[1])
                result = None
            elif command == "expect":
                result = agent.expect(*args)
            elif command == "send":
                result = agent.send(*args).value
            elif command == "cancel":
                result = agent.cancel(*args)
            elif command == "poll":
                result = [(s.request_id, s.state.value, s.reason.value if s.reason else None) for s in agent.poll()]
            elif command == "cache":
                result = big.cpu().clone()
            elif command == "pending":  # transfers and reservations the agent still holds
                result = len(agent._sending) + len(agent._receiving) + len(agent._reserved)
            elif command == "close":
                agent.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", result))
        except Exception as exc:  # report to the test instead of dying silently
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _all_threads_stopped(pid) -> bool:
    """Whether every thread of pid is in the stopped state (T, or t under a tracer)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        except OSError:  # the thread ended meanwhile
            continue
    return bool(states) and all(state in "Tt" for state in states)


class PeerProcess:
    """Test-side handle of a spawned agent process."""

    def __init__(self, backend, engine_id, num_layers=3, **overrides):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, backend, overrides, engine_id, num_layers), daemon=True)
        self.process.start()
        if not self.conn.poll(60):
            self.kill()
            raise TimeoutError("peer process did not start")
        self.metadata = self.conn.recv()

    def call(self, command, *args, timeout_s=20.0):
        self.conn.send((command, args))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"peer process did not answer {command}")
        kind, value = self.conn.recv()
        if kind == "error":
            raise RuntimeError(value)
        return value

    def collect(self, request_ids, timeout_s=15.0):
        done = {}
        deadline = time.monotonic() + timeout_s
        while not set(request_ids) <= set(done):
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer never finished {set(request_ids) - set(done)}")
            for rid, state, reason in self.call("poll"):
                done[rid] = (state, reason)
            time.sleep(0.02)
        return done

    def stop(self, timeout_s=5.0):
        """SIGSTOP the peer and return once every one of its threads has stopped. A stop takes
        effect only after the thread picked for the signal has run, and the others keep going
        until then (1.6-14 ms after kill() on this loaded box): a receiver's reader, polling its
        link, was traced reading a chunk sent after kill() had returned."""
        os.kill(self.process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not _all_threads_stopped(self.process.pid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer process {self.process.pid} not stopped after {timeout_s}s")
            time.sleep(0.0002)

    def resume(self):
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self):
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
        self.process.join(10)

    def close(self):
        try:
            if self.process.is_alive():
                self.call("close", timeout_s=5)
        except (TimeoutError, RuntimeError, OSError, EOFError):
            pass
        self.kill()


def _raw_send(conn, backend, overrides, num_bytes):
    from pd_runtime.kv_transfer.base import LinkError

    payload = torch.full((num_bytes,), 7, dtype=torch.uint8)
    if overrides.get("ipc_twin"):  # the payload goes as a copy range, as a cache's would
        from pd_runtime.kv_transfer.backends.torch_dist import TorchDistTransport

        payload.share_memory_()
        transport = TorchDistTransport("127.0.0.1", 0, torch.device("cpu"), use_ipc=True,
                                       host_shared=[payload])
    else:
        transport = transport_and_caches(backend, overrides)[1]
    conn.send(transport.address())
    link = None
    while link is None:
        link = transport.accept(1.0)
    conn.recv()  # go
    try:
        link.send_bytes(payload, 30)
        conn.send("sent")
    except LinkError as exc:
        conn.send(f"failed: {exc}")
    conn.recv()  # stop
    link.close()
    transport.close()


class RawSenderProcess(PeerProcess):
    """A peer that, on go(), sends one num_bytes message over a bare transport link."""

    def __init__(self, backend, num_bytes, **overrides):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_raw_send, args=(child, backend, overrides, num_bytes), daemon=True)
        self.process.start()
        if not self.conn.poll(60):
            self.kill()
            raise TimeoutError("raw sender did not start")
        self.address = self.conn.recv()

    def close(self):
        try:
            self.conn.send(None)
        except OSError:
            pass
        # A sender whose receiver left may sit in its send until its own timeout (UCX shm has
        # no peer-failure detection); it has nothing left to say, so it is not waited for long.
        self.process.join(1)
        self.kill()
