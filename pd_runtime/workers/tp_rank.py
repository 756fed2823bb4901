"""A follower rank of a tensor-parallel worker: the engine's follower (its part of the model and
of the KV cache, running the driver's plans) with a transfer agent over that cache, served to
the driver (kv_transfer/rank_rpc.py), so KV moves between this rank and the peers' ranks
directly. Started by the worker's engine (`LLMEngine(rank_entry=__name__)`).
"""

from __future__ import annotations

import sys

from pd_runtime.config import KVTransferConfig
from pd_runtime.engine import tp_ranks
from pd_runtime.kv_transfer.rank_rpc import RankAgentServer
from pd_runtime.kv_transfer.registry import create_agent

AGENT_PORT_KEY = "kvt/rank/{rank}"  # where a rank publishes its agent server's port


def main(argv: list[str]) -> None:
    group, runner = tp_ranks.join(argv)

    def make_agent(on_release, kv: dict, engine_id: str, model_id: str, extra: dict):
        return create_agent(KVTransferConfig(**kv), runner.kv_caches, engine_id=engine_id,
                            model_id=model_id, on_release=on_release, extra=extra)

    server = RankAgentServer(make_agent, tp_ranks.HOST)
    group.store.set(AGENT_PORT_KEY.format(rank=group.rank), str(server.port))
    runner.follow()
    group.close()


if __name__ == "__main__":
    main(sys.argv[1:])
