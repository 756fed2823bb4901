"""The former name of pd_runtime/gateway/recorder.py, kept only for the one import that still uses
it (pd_runtime/workers/router_replicas.py: `owner_name`); delete it once that import names recorder.
"""

from pd_runtime.gateway.recorder import owner_name

__all__ = ["owner_name"]
