"""What every workload is made of: requests exactly as a client would send them.

A workload drives both the in-process fleet simulation (``bench.fleetsim``), which
feeds each body to the production ``Processor``, and live runs over HTTP
(``bench.live``), so the two see byte-identical traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float  # seconds from the start of the run
    path: str  # "/v1/chat/completions" or "/v1/completions"
    body: bytes  # the JSON body, as sent
    output_tokens: int  # max_tokens in the body; the simulated engine generates exactly this
    family: str  # e.g. "chat", "docqa", "agent", "fewshot", "mooncake", "azure-code"
    session: str  # conversation / document / agent run id
    headers: dict[str, str] = field(default_factory=dict)  # e.g. authorization, x-session-id


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """A change to the fleet during a run (the stress shapes): pod ``slot`` leaves or
    joins, or loses its cache unannounced (a restart: ``bench.precise_sim --clear-every``)."""

    at_s: float
    action: str  # "remove" | "add" | "clear"
    slot: int


@dataclass(slots=True)
class Workload:
    name: str
    description: str
    requests: list[Request]  # sorted by arrival_s
    events: list[FleetEvent] = field(default_factory=list)
    # Pods that exist in the fleet but take no traffic until an "add" event.
    initially_absent: tuple[int, ...] = ()
    # LoRA adapters: the engine's --max-loras the workload is meant for (its requests
    # name adapters as their model); 0: the base model only.
    max_loras: int = 0


def scaled_out(workload: Workload, pods: int, late: int) -> Workload:
    """``workload`` on ``pods`` pods of which the last ``late`` join a third of the way
    through (a scale-out: they start with empty caches, and engines that have shown
    nothing yet)."""
    if not 0 < late < pods:
        raise ValueError(f"late pods must be between 1 and {pods - 1}, got {late}")
    if workload.events or workload.initially_absent:
        raise ValueError(f"{workload.name} already adds or removes pods")
    at = round(workload.requests[-1].arrival_s / 3, 3) if workload.requests else 0.0
    slots = tuple(range(pods - late, pods))
    return Workload(
        name=workload.name,
        description=f"{workload.description}; pods {slots} join at {at:g} s",
        requests=workload.requests,
        events=[FleetEvent(at, "add", slot) for slot in slots],
        initially_absent=slots,
        max_loras=workload.max_loras,
    )


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file and line."""


def replay_speed(arrivals_s: list[float], speed: float | None, rate: float | None) -> float:
    """How much faster than recorded a trace replays: ``speed`` given directly, or the
    speed-up that makes the mean arrival rate ``rate`` requests/s; not both."""
    if speed is not None and rate is not None:
        raise ValueError("give speed or rate, not both")
    if rate is not None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        span = arrivals_s[-1] - arrivals_s[0] if arrivals_s else 0.0
        if span <= 0:
            raise ValueError("the trace's requests all arrive at once: a rate cannot be set")
        speed = rate / ((len(arrivals_s) - 1) / span)
    speed = 1.0 if speed is None else speed
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    return speed
