"""``Outcome``: the decision for one request, and everything Envoy must be told about
it. ``processor.py`` makes it and ``mutate.py`` writes it out, neither importing the
other."""

from __future__ import annotations

from dataclasses import dataclass

from ace_extproc.config import Mode, Pod

# The header that pins a request to a pod (cluster mode: the pod's own Envoy cluster).
UPSTREAM_HEADER = "x-ace-upstream"


@dataclass(slots=True)
class Outcome:
    """The decision for one request, and everything Envoy must be told about it."""

    mode: Mode
    action: str
    prefix_key: str = "-"
    pod: Pod | None = None  # pinned only in prod
    would_pick: Pod | None = None  # the decision, in any mode
    saved_tokens: int = 0
    speedup: float = 1.0  # estimated: cold TTFT over warm (calibrated TTFT model)
    saved_ms: float = 0.0  # estimated: cold TTFT less warm, for the metrics
    body: bytes | None = None  # the rewritten body (prod)
    reject_status: int = 0  # answer the client directly with this status
    reject_body: bytes = b""
    fallbacks: tuple[Pod, ...] = ()  # next-best pods for Envoy's retries (endpoint mode)
    endpoint: bool = False  # name pods by ip:port (router.upstream_mode: endpoint)
    path: str | None = None  # a new :path (the native API's request becomes a chat)
    slot: int = -1  # the picked pod's slot (any mode), for the metrics
    prompt_tokens: int = 0  # estimated from the canonical prompt
    # The pinned destination's own ``authorization`` (its api_key_env), for the client's.
    upstream_auth: bytes | None = None
    # For the metrics: the routed steps' times (parse, hash, pick, rewrite; ns).
    steps_ns: tuple[int, int, int, int] | None = None
    # Responses API: the tenant whose stored response the answer will be (its id is
    # then remembered as it passes: observe.py), and what became of the turn's
    # previous_response_id (routing/homes.py's results; "" where it named none).
    store_tenant: str = ""
    previous_response: str = ""
    # The number of its pick of a LoRA adapter on the pinned pod (0: none): its answer
    # frees the adapter's slot in the router's view (routing/lora.py).
    lora_pick: int = 0
    # What the request's LoRA adapter needed on the picked pod, as the router saw it:
    # "loaded", "load" or "wait" for a slot (routing/lora.py); "" for none.
    adapter: str = ""
    adapter_slots: str = ""  # the slots other adapters in use held there, as "3/4"

    @property
    def trace(self) -> str:
        trace = (
            f"mode={self.mode},action={self.action},prefix_key={self.prefix_key},"
            f"saved_prefill_tokens={self.saved_tokens},speedup={self.speedup:.2f}"
        )
        if self.previous_response:
            trace += f",previous_response={self.previous_response}"
        if self.adapter:
            trace += f",adapter={self.adapter},adapter_slots_busy={self.adapter_slots}"
        return trace
