"""The raw communication of one tensor-parallel worker: its ranks' process group (the
all-reduces of the model's row-parallel layers) and the driver's plan channel to the others.

Collectives go through torch.distributed: NCCL between GPUs, gloo on the CPU (the CPU twin
`make test` runs). Plans do not: a follower waits for the next one as long as the driver is
idle (an offline LLM between `generate` calls, a worker with no requests), which no collective
timeout allows, so they travel as length-prefixed pickles over one loopback socket per follower
(the ranks of a worker share a node). A closed socket is the driver gone: the follower stops.
"""

from __future__ import annotations

import datetime
import pickle
import socket
import struct

import torch
import torch.distributed as dist

_HEADER = struct.Struct("!Q")


class TensorParallelError(RuntimeError):
    """A rank could not join its group, or a peer rank is gone."""


class TensorParallelGroup:
    """Rank `rank` of `size`; rank 0 is the driver (it schedules and samples).

    Built by every rank with the driver's store address: `TensorParallelGroup.create_store`
    on the driver first (it binds the port), then one constructor call per rank.
    """

    def __init__(self, rank: int, size: int, host: str, port: int, device: torch.device,
                 timeout_s: float = 120.0, store: dist.TCPStore | None = None):
        self.rank, self.size, self.device = rank, size, torch.device(device)
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            self.store = store or dist.TCPStore(host, port, size, False, timeout=timeout)
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            options._timeout = timeout
            prefix = dist.PrefixStore("tp", self.store)
            self.cpu_group = dist.ProcessGroupGloo(prefix, rank, size, options)
            self.data_group = self._nccl(rank, size, timeout) \
                if self.device.type == "cuda" else self.cpu_group
        except (RuntimeError, dist.DistStoreError) as exc:
            raise TensorParallelError(f"rank {rank} of {size} could not join its group at "
                                      f"{host}:{port}: {exc}") from exc
        self._plan_sockets = self._connect_plans(host)

    def _nccl(self, rank: int, size: int, timeout: datetime.timedelta):
        """NCCL with the group's timeout: its watchdog ends a process whose collective waits
        longer (a lost peer: NCCL's wait() returns before the GPU work does, so only the
        watchdog, or the driver's check of its ranks' processes, notices)."""
        store = dist.PrefixStore("tp/nccl", self.store)
        try:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
        except (AttributeError, TypeError):  # a torch without the option: NCCL's default
            return dist.ProcessGroupNCCL(store, rank, size)
        return dist.ProcessGroupNCCL(store, rank, size, options)

    @staticmethod
    def create_store(host: str, size: int, timeout_s: float = 120.0) -> dist.TCPStore:
        """The driver's rendezvous store on a free port (`.port`), for the group's ranks."""
        return dist.TCPStore(host, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place. On the CPU past two ranks the partial sums
        are gathered and added in rank order: gloo's ring adds a row's pieces in an order that
        follows the tensor's size, which would make a token's result depend on its batch (two
        ranks' sums are one addition, the same either way)."""
        if self.size == 1:
            return tensor
        if self.device.type == "cpu" and self.size > 2:
            parts = self.all_gather(tensor)
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            tensor.copy_(total)
            return tensor
        self._wait(self.data_group.allreduce([tensor]), "all-reduce")
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on each), in rank order."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._wait(self.data_group.allgather([parts], [tensor]), "all-gather")
        return parts

    def agree(self, value: int, what: str) -> None:
        """Check that every rank computed the same `value` (a block count, a layer count)."""
        values = [int(v) for v in self._cpu_gather(torch.tensor([value], dtype=torch.long))]
        if len(set(values)) > 1:
            raise TensorParallelError(f"the ranks disagree on {what}: {values} (rank order)")

    def _cpu_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._wait(self.cpu_group.allgather([parts], [tensor]), "all-gather")
        return parts

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # a peer rank died or timed out: the worker is lost
            raise TensorParallelError(f"tensor-parallel {what} failed on rank {self.rank} of "
                                      f"{self.size}: {exc}") from exc

    # -- plans -----------------------------------------------------------------------------
    def _connect_plans(self, host: str) -> list[socket.socket]:
        """The driver listens and publishes its port in the store; each follower connects."""
        if self.size == 1:
            return []
        if self.rank == 0:
            listener = socket.create_server((host, 0))
            listener.settimeout(self.timeout_s)
            self.store.set("tp/plan_port", str(listener.getsockname()[1]))
            peers: dict[int, socket.socket] = {}
            try:
                while len(peers) < self.size - 1:
                    conn, _ = listener.accept()
                    conn.settimeout(None)
                    rank = _HEADER.unpack(_read_exactly(conn, _HEADER.size))[0]
                    peers[rank] = conn
            except OSError as exc:
                raise TensorParallelError(f"the driver's plan channel: {exc}") from exc
            finally:
                listener.close()
            for conn in peers.values():
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return [peers[r] for r in sorted(peers)]
        port = int(self.store.get("tp/plan_port"))
        conn = socket.create_connection((host, port), timeout=self.timeout_s)
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(_HEADER.pack(self.rank))
        return [conn]

    def send_plan(self, plan) -> None:
        """Driver: the step's plan to every follower (None: stop)."""
        frame = pickle_frame(plan)
        try:
            for conn in self._plan_sockets:
                conn.sendall(frame)
        except OSError as exc:
            raise TensorParallelError(f"a follower rank is gone: {exc}") from exc

    def recv_plan(self):
        """Follower: the next plan, waiting as long as the driver is idle; None once the
        driver sent its stop or is gone."""
        conn = self._plan_sockets[0]
        try:
            return read_pickle_frame(conn)
        except (OSError, EOFError):
            return None

    def close(self) -> None:
        for conn in self._plan_sockets:
            try:
                conn.close()
            except OSError:
                pass
        self._plan_sockets = []


def pickle_frame(message) -> bytes:
    """One message as a length-prefixed pickle (the plan channel's frames, and the rank
    agents' calls, kv_transfer/rank_rpc.py)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def read_pickle_frame(conn: socket.socket):
    """The next message of `pickle_frame`s on `conn` (EOFError: the peer closed it)."""
    return pickle.loads(_read_exactly(conn, _HEADER.unpack(_read_exactly(conn, _HEADER.size))[0]))


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
