"""Tenants: API keys to tenant ids, prefix-cache isolation salts, per-tenant rate limits.

Limits are token buckets refilled continuously: `requests_per_minute` counts requests,
`tokens_per_minute` counts prompt plus max_tokens at admission (what a request may cost). With
router replicas the buckets live in the shared store (pd_runtime/gateway/store.py `take`), one per tenant
and limit, so a tenant's limit holds for all replicas together.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Optional

from pd_runtime.config import TenantConfig
from pd_runtime.router.backend import BackendError


class AuthError(BackendError):
    """Missing or wrong API key (HTTP 401)."""

    def __init__(self, message: str):
        super().__init__(401, message, code="invalid_api_key")


class _Bucket:
    def __init__(self, per_minute: int):
        self.capacity = float(per_minute)
        self.level = float(per_minute)
        self.rate = per_minute / 60.0
        self.stamp = time.monotonic()

    def take(self, amount: float) -> float:
        """0 if taken; else seconds until `amount` would be available (nothing taken)."""
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity:
            return float("inf")
        return (amount - self.level) / self.rate


class Tenants:
    def __init__(self, tenants: list[TenantConfig], shared=None):
        """`shared`: a RunStore whose buckets every router replica draws from (None: this
        process's own buckets)."""
        self.shared = shared
        self.by_key = {t.api_key: t for t in tenants}
        self._requests = {t.tenant_id: _Bucket(t.requests_per_minute)
                          for t in tenants if t.requests_per_minute}
        self._tokens = {t.tenant_id: _Bucket(t.tokens_per_minute)
                        for t in tenants if t.tokens_per_minute}

    @property
    def keys_required(self) -> bool:
        return bool(self.by_key)

    def authenticate(self, api_key: Optional[str]) -> Optional[TenantConfig]:
        if not self.by_key:
            return None
        if not api_key:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        for key, tenant in self.by_key.items():
            if hmac.compare_digest(key.encode(), api_key.encode()):
                return tenant
        raise AuthError("invalid API key")

    @staticmethod
    def cache_salt(tenant: Optional[TenantConfig],
                   request_salt: Optional[str] = None) -> Optional[str]:
        """Each tenant's prefix cache is its own unless it is configured to share; a request's
        own salt (vLLM's cache_salt) divides it further: within its tenant, never across. JSON
        keeps the parts apart, and no tenant id (no "[" in one) spells a salted request's."""
        salt = None if tenant is None or tenant.share_prefix_cache else tenant.tenant_id
        if request_salt is not None:
            salt = json.dumps(["request", salt, request_salt])
        return salt

    def admit(self, tenant: Optional[TenantConfig], tokens: int) -> tuple[Optional[str], float]:
        """(None, 0) if admitted; else (which limit, seconds to wait)."""
        if tenant is None:
            return None, 0.0
        req = self._requests.get(tenant.tenant_id)
        tok = self._tokens.get(tenant.tenant_id)
        if req is not None:
            wait = req.take(1)
            if wait:
                return "requests_per_minute", wait
        if tok is not None:
            wait = tok.take(tokens)
            if wait:
                if req is not None:
                    req.level += 1  # give the request back: it was not admitted
                return "tokens_per_minute", wait
        return None, 0.0

    async def admit_async(self, tenant: Optional[TenantConfig], tokens: int
                          ) -> tuple[Optional[str], float]:
        """admit(), from the shared buckets when there are any (off the event loop)."""
        if self.shared is None or tenant is None:
            return self.admit(tenant, tokens)
        return await asyncio.to_thread(self._admit_shared, tenant, tokens)

    async def refund_async(self, tenant: Optional[TenantConfig], tokens: int) -> None:
        if self.shared is None or tenant is None:
            return self.refund(tenant, tokens)
        await asyncio.to_thread(self._refund_shared, tenant, tokens)

    def _limits(self, tenant: TenantConfig, tokens: int):
        for kind, per_minute, amount in (("requests", tenant.requests_per_minute, 1),
                                         ("tokens", tenant.tokens_per_minute, tokens)):
            if per_minute:
                yield f"{tenant.tenant_id}/{kind}", f"{kind}_per_minute", float(per_minute), \
                    amount

    def _admit_shared(self, tenant: TenantConfig, tokens: int) -> tuple[Optional[str], float]:
        taken = []
        for bucket, limit, per_minute, amount in self._limits(tenant, tokens):
            wait = self.shared.take(bucket, per_minute, per_minute / 60.0, amount, time.time())
            if wait:
                for name, capacity, given in taken:  # not admitted: give back what it took
                    self.shared.give_back(name, capacity, given)
                return limit, wait
            taken.append((bucket, per_minute, amount))
        return None, 0.0

    def _refund_shared(self, tenant: TenantConfig, tokens: int) -> None:
        for bucket, _, per_minute, amount in self._limits(tenant, tokens):
            self.shared.give_back(bucket, per_minute, amount)

    def refund(self, tenant: Optional[TenantConfig], tokens: int) -> None:
        """Give back what admit() took for a request that was then refused, not served (a
        client retrying an overload 429 must not drain its own rate limit)."""
        if tenant is None:
            return
        for bucket, amount in ((self._requests.get(tenant.tenant_id), 1),
                               (self._tokens.get(tenant.tenant_id), tokens)):
            if bucket is not None:
                bucket.level = min(bucket.capacity, bucket.level + amount)
