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


def link_faults_unsupported() -> Optional[str]:
    """None when workers take link faults (set_fault_injection(link_faults=...)), else why not."""
    from pd_runtime.workers.worker import PDWorker

    if "link_faults" not in inspect.signature(PDWorker.set_fault_injection).parameters:
        return "PDWorker.set_fault_injection takes no link_faults (link faults not exposed)"
    return None


def set_link_faults(product: ServedProduct, worker_id: str, timeout_s: float = 10.0,
                    **faults: float) -> None:
    """Faults on the KV this worker sends from now on (pd_runtime/kv_transfer/faults.py LinkFaults:
    drop, corrupt, duplicate per-chunk probabilities, delay_s per chunk, seed); no kinds
    given: clean links again."""
    unknown = set(faults) - set(LINK_FAULT_KINDS) - {"seed"}
    if unknown:
        raise ValueError(f"unknown link fault kinds {sorted(unknown)}")
    actor = product.actor(worker_id)
    product.ray.get(actor.set_fault_injection.remote(link_faults=dict(faults)),
                    timeout=timeout_s)


def link_fault_counts(product: ServedProduct, worker_id: str, timeout_s: float = 10.0) -> dict:
    """Chunks this worker's links saw and the faults they applied, since the worker started."""
    load = product.ray.get(product.actor(worker_id).load.remote(), timeout=timeout_s)
    return dict((load.get("kv_transfer") or {}).get("link_faults") or {})
