"""Routing: where each request runs and whether it is admitted. The policy (policy.py: colocated
or disaggregated, which workers, SLO admission) over its inputs (cost_model.py, ledger.py,
prefix_index.py), tenants' keys, cache salts and rate limits (tenants.py), the live reload of the
routing section (reload.py), the router's metrics (metrics.py, metrics_vllm.py), and PoolBackend
(core.py), which drives the worker pools through the pool client it is handed, behind the Backend
contract the HTTP layer serves through (backend.py). It may import, of pd_runtime, only the
router <-> worker contract (api, errors, tokenizer), the config models and their loader,
cpu_time and engine.block_hash: no HTTP layer (entrypoints), parsers or run records (gateway),
no engine, model, worker or transfer module, no torch and no Ray (docs/architecture.md, "Who may
import what"; tests/test_module_boundaries.py).
"""
