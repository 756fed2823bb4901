"""Fault injection on a real transport: a wrapper whose links flip one byte of the next KV
region they send (the source blocks stay intact), to prove checksums catch wire corruption.
"""

from __future__ import annotations


from kv_transfer.base import FRAME_BYTES, Link, Transport, as_byte_tensor


class CorruptingLink(Link):
    def __init__(self, inner: Link, owner: "CorruptingTransport"):
        self.inner, self.owner = inner, owner

    def send_bytes(self, buf, timeout_s):
        # Control frames are exactly FRAME_BYTES; tests size KV regions differently.
        buf = as_byte_tensor(buf)
        if self.owner.armed and buf.numel() != FRAME_BYTES:
            self.owner.armed = False
            buf = buf.clone()
            buf[buf.numel() // 2] ^= 0x5A
        self.inner.send_bytes(buf, timeout_s)

    def recv_bytes(self, buf, timeout_s):
        self.inner.recv_bytes(buf, timeout_s)

    def set_activity(self, active):
        self.inner.set_activity(active)

    def close(self):
        self.inner.close()


class CorruptingTransport(Transport):
    def __init__(self, inner: Transport):
        self.inner, self.name, self.armed = inner, inner.name, False

    def address(self):
        return self.inner.address()

    def connect(self, peer_address, timeout_s):
        return CorruptingLink(self.inner.connect(peer_address, timeout_s), self)

    def accept(self, timeout_s):
        link = self.inner.accept(timeout_s)
        return CorruptingLink(link, self) if link is not None else None

    def close(self):
        self.inner.close()
