"""What the gateway's HTTP tests share: two tenants with API keys, the router config over
them, a scripted backend that paces word chunks and knows the keys, and readers of an SSE body
and of a served app's run recorder."""

from __future__ import annotations

from pd_runtime.config import RouterConfig, TenantConfig
from pd_runtime.router.tenants import Tenants
from tests.router_support.scripted_backend import ScriptedBackend, token_chunk

TENANTS = [TenantConfig(tenant_id="acme", api_key="sk-acme"),
           TenantConfig(tenant_id="beta", api_key="sk-beta")]
ACME = {"Authorization": "Bearer sk-acme"}
BETA = {"Authorization": "Bearer sk-beta"}
SSE = {"Accept": "text/event-stream"}  # a client that reads SSE as SSE: events get ids


def config(**runs) -> RouterConfig:
    return RouterConfig(tenants=TENANTS, routing={"mode": "always_colocated"}, runs=runs)


def events(raw: bytes) -> list[bytes]:
    return [part + b"\n\n" for part in raw.split(b"\n\n") if part]


def recorder(port):
    from tests.router_support.serving import APPS

    return APPS[port].state.recorder


def words(count: int, then_end: bool = False) -> list[dict]:
    """A script of `count` word chunks, and a last " end" chunk that finishes it."""
    script = [token_chunk(f" w{i}", i + 1) for i in range(count)]
    return script + [token_chunk(" end", count + 1, finished=True)] if then_end else script


class TenantScripted(ScriptedBackend):
    """The scripted backend (paced chunks) with the router's API keys."""

    def __init__(self, tokenizer, script, step_s):
        super().__init__(tokenizer, script, step_s=step_s)
        self.tenants = Tenants(TENANTS)
        self.calls = 0

    def authenticate(self, api_key):
        return self.tenants.authenticate(api_key)

    async def generate(self, *args, **kwargs):
        self.calls += 1
        async for chunk in super().generate(*args, **kwargs):
            yield chunk
