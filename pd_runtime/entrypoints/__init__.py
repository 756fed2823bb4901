"""The ways into a running pd-runtime over the network; one today, the OpenAI-compatible HTTP
server (openai/), which `pd-runtime serve` (cli.py) and the router replicas
(workers/router_replicas.py) start. It sits at the top of the serving path: it may import the
router, the parsers, the run records (gateway) and the shared top-level modules, and nothing
below imports it (docs/architecture.md, "Who may import what").
"""
