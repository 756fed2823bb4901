"""The one owner of an agent's transfer state and of the lock that guards it: transfers in
flight on each side, reserved destination blocks, metrics, and where finished statuses go.

Memory is flat by construction. Every per-request entry is added when a transfer starts
(send/expect) and removed by finish(), the one place a transfer ends, whatever ended it (done,
failed, cancelled, timed out, peer lost, shut down). A finished status goes to on_release when
the agent has one, and is queued for poll() only when it has none; `recent` keeps the latest
RECENT_STATUSES of them for status() after the end, and no more. No I/O here.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from pd_runtime.kv_transfer.base import Activity, ReleaseCallback, Role, TransferState, TransferStatus
from pd_runtime.kv_transfer.flow import Transfer, TransferMetrics

RECENT_STATUSES = 4096


class TransferBook:
    """Transfer records of one agent. Every caller holds `lock` (re-entrant) while it reads or
    changes a record or a table; on_release runs under it, on the thread that ended the transfer."""

    def __init__(self, on_release: Optional[ReleaseCallback]):
        self.lock = threading.RLock()
        self.sending: dict[str, Transfer] = {}
        self.receiving: dict[str, Transfer] = {}
        self.reserved: dict[str, list[int]] = {}  # receiver: destination blocks per expected request
        self.metrics = TransferMetrics()
        # Set while any transfer is pending here: link readers poll fast then, and an idle
        # reader wakes on it (Link.set_activity).
        self.active = Activity()
        self._on_release = on_release
        self._finished: list[TransferStatus] = []  # for poll(); only without on_release
        self._recent: dict[tuple, TransferStatus] = {}  # (role, request id) -> status, oldest first

    def pending(self) -> list[Transfer]:
        return list(self.sending.values()) + list(self.receiving.values())

    def finish(self, transfer: Transfer, state: TransferState, reason) -> bool:
        """End a transfer: its entries leave every table, its credits go back to the window it
        was admitted on, its status is published. False when it had ended already."""
        if transfer.finished:
            return False
        transfer.state, transfer.reason = state, reason
        table = self.sending if transfer.role is Role.SEND else self.receiving
        table.pop(transfer.request_id, None)
        if transfer.role is Role.RECV:
            self.reserved.pop(transfer.request_id, None)
        if not self.sending and not self.receiving:
            self.active.clear()
        if transfer.credits is not None:  # the window it was admitted on (a link may be replaced since)
            transfer.credits.returned(transfer.unacked_bytes)
            transfer.credits.dequeued(transfer.queued_sends)  # layers that never left
        transfer.unacked_bytes, transfer.queued_sends, transfer.queued_layers = 0, 0, []
        self.metrics.observe_finish(transfer, time.monotonic())
        status = transfer.status()
        self._recent[(transfer.role, transfer.request_id)] = status
        if len(self._recent) > RECENT_STATUSES:
            self._recent.pop(next(iter(self._recent)))
        if self._on_release is not None:
            self._on_release(status)
        else:
            self._finished.append(status)
        return True

    def status(self, request_id: str, role: Role) -> Optional[TransferStatus]:
        table = self.sending if role is Role.SEND else self.receiving
        if request_id in table:
            return table[request_id].status()
        return self._recent.get((role, request_id))

    def ended(self, request_id: str, role: Role) -> Optional[TransferStatus]:
        """How a transfer that is no longer pending ended, if it is still remembered."""
        return self._recent.get((role, request_id))

    def drain(self) -> list[TransferStatus]:
        finished, self._finished = self._finished, []
        return finished

    def sizes(self) -> dict[str, int]:
        return {"sending": len(self.sending), "receiving": len(self.receiving),
                "reserved": len(self.reserved), "finished": len(self._finished),
                "recent": len(self._recent)}
