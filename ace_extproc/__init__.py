"""ace-extproc: prefix-cache-aware routing for LLM fleets, as an Envoy ext_proc sidecar.

Follow one request in this order: ``server`` (the gRPC stream) -> ``processor``
(the decision) -> ``request`` (body to canonical prompt) -> ``prefix`` (block
hashes) -> ``routing`` (picking a pod) -> ``mutate`` (what Envoy is told).
"""

__version__ = "0.1.0"
