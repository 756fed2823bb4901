"""Fault injectors against the served product's workers: kill -9, SIGSTOP / SIGCONT, the
prefill worker's KV-send delay, and link-level faults (drop, delay, corrupt, duplicate).

Pids come from the product (/health, or the actor's load report); actor settings go over Ray.
"""

from __future__ import annotations

import inspect
import os
import signal
from typing import Optional

from tests.chaos_support.product import ServedProduct

LINK_FAULT_KINDS = ("drop", "delay_s", "corrupt", "duplicate")
# The worker methods that may carry link faults (kv_transfer/faults.py LinkFaults fields: drop,
# corrupt, duplicate as per-chunk probabilities, delay_s seconds per chunk, seed), first found
# wins; the link phases run once one of them takes every kind.
LINK_FAULT_METHODS = ("set_link_faults", "set_fault_injection")


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def set_kv_send_delay(product: ServedProduct, worker_id: str, seconds: float,
                      timeout_s: float = 10.0) -> None:
    """Hold each KV send this long after the prefill's first token: a wide window in which
    a transfer is pending (blocks reserved on the decode side, held on the prefill side)."""
    actor = product.actor(worker_id)
    product.ray.get(actor.set_fault_injection.remote(delay_kv_send_s=seconds), timeout=timeout_s)


def _link_fault_method() -> Optional[str]:
    from pd_runtime.workers.worker import PDWorker

    for name in LINK_FAULT_METHODS:
        method = getattr(PDWorker, name, None)
        if method is None:
            continue
        params = inspect.signature(method).parameters
        if all(k in params for k in LINK_FAULT_KINDS) or any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return name
    return None


def link_faults_unsupported() -> Optional[str]:
    """None when a worker method takes every link fault kind, else why the phase cannot run."""
    if _link_fault_method() is None:
        return (f"no PDWorker method among {LINK_FAULT_METHODS} takes the link fault kinds "
                f"{LINK_FAULT_KINDS} (link fault injection is not exposed on the worker yet)")
    return None


def set_link_faults(product: ServedProduct, worker_id: str, timeout_s: float = 10.0,
                    **faults: float) -> None:
    """Set the link faults of one worker's agent: the kinds given, every other kind off (no
    kinds given: all off)."""
    unknown = set(faults) - set(LINK_FAULT_KINDS) - {"seed"}
    if unknown:
        raise ValueError(f"unknown link fault kinds {sorted(unknown)}")
    method = _link_fault_method()
    if method is None:
        raise RuntimeError(link_faults_unsupported())
    settings = {k: float(faults.get(k, 0.0)) for k in LINK_FAULT_KINDS}
    settings["seed"] = int(faults.get("seed", 0))
    actor = product.actor(worker_id)
    product.ray.get(getattr(actor, method).remote(**settings), timeout=timeout_s)
