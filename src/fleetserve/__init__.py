"""fleetserve: serve LLMs across cards and machines.

Parts (each usable alone):

* ``fleetserve.router`` -- cache-aware HTTP load balancer (no torch import).
* ``fleetserve.engine`` -- one inference instance: radix cache, continuous
  batching, TP / DP attention / EP.
* ``fleetserve.bench`` -- workloads, load generator, simulated workers.

``fleetserve.Engine`` is imported lazily so that ``import fleetserve`` (and the
router) never pulls in torch.
"""

__version__ = "0.1.0"

__all__ = ["Engine", "__version__"]


def __getattr__(name: str):
    if name == "Engine":
        from fleetserve.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'fleetserve' has no attribute {name!r}")
