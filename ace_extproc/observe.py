"""What became of each request, seen after routing, from two reports that never overlap.

**Envoy's gRPC access log** (``access_log.py``, always on with ``observe_responses``):
one entry per request, batched on one long-lived stream per Envoy worker, with the
routing filter's decision (the ``ace`` dynamic metadata), the host that answered last,
the status, Envoy's response flags and how many attempts the router made. From it
(``Observer.record``):

* **passive health**: a pod's own 5xx, or Envoy's report that it timed out, reset or
  could not be reached, counts a failure against it; any other answer a success; a
  pinned pod that Envoy retried away from counts a failure too. Envoy's own refusals
  (overflow, no route) count for nothing, nor do the answers to bodies the router
  already found malformed (a client can make an engine fail on purpose). The
  outlier detector (``routing/outlier.py``) decides what the failures mean.
* **the ledger's counts**: responses, failures and the router's estimate of the
  prefill it saved, per mode and per pod (``Ledger``).
* **LoRA adapters in use**: the answer to a pinned request for an adapter frees it in
  the router's view of the pod (``routing/lora.py``) before the next scrape would.

**An observe-only ext_proc filter**, only with ``usage_capture`` (only it can read a
response body): Envoy's observability mode sends it each response without waiting for
answers, and it reports **the engine's own reuse**, ``usage.prompt_tokens_details.
cached_tokens`` next to the router's estimate for the same responses, per mode, so
shadow mode shows what default routing really reused next to what the router predicts
it would have (``Observer.finish``). It reports usage only: the access log already
counted the response, so nothing counts twice whichever report arrives first.

The same filter reads the answers to Responses-API requests the engine is asked to
store (the routing filter marks them, ``store_tenant``; the rendered Envoy sends their
bodies to it even without usage capture): the id of each stored response, and the pod
that answered, for the later turns that must go back to it (``routing/homes.py``),
shared with the other replicas where they share placements. Its usage (Responses'
``input_tokens``) counts like any other where usage capture is on.

The request path never waits on either.
"""

from __future__ import annotations

import logging
import re
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from google.protobuf.struct_pb2 import Value

from ace_extproc.request import BODY_FAULTS
from ace_extproc.response_id import StoredId
from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.homes import ResponseHomes
from ace_extproc.routing.outlier import OutlierDetector
from ace_extproc.telemetry import BOUNDS_NS

if TYPE_CHECKING:
    from ace_extproc.routing.replicas import HomeSink

log = logging.getLogger("ace_extproc.observe")

ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"  # where Envoy puts requested attributes
# Usage sits at the end of a JSON completion and in the last SSE chunks: keep a tail.
TAIL_BYTES = 8192
# Envoy's response flags that mean the pod failed the request: upstream request
# timeout (UT), remote reset (UR), connection failure (UF), connection termination
# (UC). Others (overflow, no route, rate limits) are Envoy's verdicts, not the pod's.
POD_FAULTS = (1 << 2) | (1 << 4) | (1 << 5) | (1 << 6)
# The router's actions for bodies it found malformed: their answers are the client's doing.
CLIENT_FAULTS = frozenset(
    f"{prefix}_{reason}" for prefix in ("bypass", "reject") for reason in BODY_FAULTS
)
# Chat and completions say prompt_tokens, the Responses API input_tokens.
_PROMPT = re.compile(rb'"(?:prompt|input)_tokens":\s*(\d+)')
_CACHED = re.compile(rb'"cached_tokens":\s*(\d+)')


@dataclass(slots=True)
class Totals:
    """One mode's responses since start."""

    responses: int = 0
    failed: int = 0  # 5xx, Envoy's own included
    estimated_saved_tokens: int = 0  # the router's estimate (prod: did; shadow: would)
    with_usage: int = 0  # responses whose usage the engine reported
    prompt_tokens: int = 0  # from those responses' usage
    cached_tokens: int = 0  # the engine's cached_tokens, same responses
    # The router's estimate for the same responses, in the engine's tokens: its saved
    # share of each prompt times the engine's prompt_tokens. The router counts tokens as
    # prompt bytes / bytes_per_token, which a real tokenizer does not follow (on the
    # real-engine tier's model, 2.3-3.3 bytes a token rather than 4): a count in its units
    # against the engine's would be off by that ratio, a share is not.
    estimated_saved_with_usage: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class Holds:
    """Envoy's holds of requests on their way to a pod: counts by ``BOUNDS_NS`` bucket."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS_NS) + 1))
    sum_ns: int = 0

    def add(self, ns: int) -> None:
        self.counts[bisect_left(BOUNDS_NS, ns)] += 1
        self.sum_ns += ns


@dataclass(slots=True)
class Ledger:
    """Responses by mode, and by the pod that answered (pod key -> Totals); Envoy's
    holds by mode."""

    by_mode: dict[str, Totals] = field(default_factory=dict)
    by_pod: dict[str, Totals] = field(default_factory=dict)
    holds: dict[str, Holds] = field(default_factory=dict)

    def _tallies(self, obs: Observation, pod_key: str | None) -> list[Totals]:
        tallies = [self.by_mode.setdefault(obs.mode or "none", Totals())]
        if pod_key:
            tallies.append(self.by_pod.setdefault(pod_key, Totals()))
        return tallies

    def add(self, obs: Observation, pod_key: str | None) -> None:
        """One response, and its usage where it carries one."""
        for totals in self._tallies(obs, pod_key):
            totals.responses += 1
            totals.failed += obs.status >= 500
            totals.estimated_saved_tokens += obs.saved_tokens
        if obs.hold_ns is not None:
            self.holds.setdefault(obs.mode or "none", Holds()).add(obs.hold_ns)
        self.add_usage(obs, pod_key)

    def add_usage(self, obs: Observation, pod_key: str | None) -> None:
        """The engine's usage of a response counted already (or never: ``add``)."""
        if obs.cached_tokens is None or not obs.prompt_tokens:
            return
        for totals in self._tallies(obs, pod_key):
            totals.with_usage += 1
            totals.prompt_tokens += obs.prompt_tokens
            totals.cached_tokens += obs.cached_tokens
            totals.estimated_saved_with_usage += obs.estimated_in_engine_tokens()


@dataclass(slots=True)
class Observation:
    """One response, as the access log reported it or the observe filter saw it."""

    mode: str = ""
    action: str = ""
    pinned: str = ""  # the pod key ace-extproc pinned (prod), else ""
    would_pick: str = ""  # the pod key it picked, in any mode
    saved_tokens: int = 0  # its estimate of the prefill the pick saves
    estimated_prompt_tokens: int = 0  # its estimate of the prompt, in the same units
    upstream: str = ""  # ip:port of the host that answered last, if any
    status: int = 0
    flags: int = 0  # Envoy's response flags bitmask
    attempts: int = 0  # upstream attempts the router made (access log); 0: not known
    prompt_tokens: int = 0  # from the engine's usage
    cached_tokens: int | None = None
    tail: bytearray = field(default_factory=bytearray)
    # A Responses answer the engine is asked to store: whose (the tenant), and its id
    # as read from the body (None: not such an answer).
    store_tenant: str = ""
    stored: StoredId | None = None
    remembered: bool = False  # its id has been noted (as soon as it could be)
    lora_pick: int = 0  # its pick of a LoRA adapter on the pinned pod (0: none)
    # Envoy's hold (access log): the request's last byte in to its first byte out to a
    # pod, in ns; None where it reached none or the report does not say.
    hold_ns: int | None = None

    def estimated_in_engine_tokens(self) -> int:
        """``saved_tokens`` scaled to the engine's count of the prompt (Totals)."""
        if not self.estimated_prompt_tokens:
            return self.saved_tokens
        return round(self.saved_tokens * self.prompt_tokens / self.estimated_prompt_tokens)

    def read_decision(self, f: Mapping[str, Value]) -> None:
        """The routing filter's ``ace`` metadata (``mutate.metadata``), as either report
        carries it."""
        self.mode = f["mode"].string_value if "mode" in f else ""
        self.action = f["action"].string_value if "action" in f else ""
        self.pinned = f["served_by"].string_value if "served_by" in f else ""
        self.would_pick = f["pod"].string_value if "pod" in f else ""
        self.saved_tokens = int(f["saved_tokens"].number_value) if "saved_tokens" in f else 0
        self.estimated_prompt_tokens = (
            int(f["prompt_tokens"].number_value) if "prompt_tokens" in f else 0
        )
        self.store_tenant = f["store_tenant"].string_value if "store_tenant" in f else ""
        self.lora_pick = int(f["lora_pick"].number_value) if "lora_pick" in f else 0

    def on_headers(self, msg: ProcessingRequest) -> None:
        ace = msg.metadata_context.filter_metadata.get("ace")
        if ace is not None:
            self.read_decision(ace.fields)
        attrs = msg.attributes.get(ATTRIBUTES_KEY)
        if attrs is not None:
            a = attrs.fields
            self.upstream = a["upstream.address"].string_value if "upstream.address" in a else ""
            self.flags = int(a["response.flags"].number_value) if "response.flags" in a else 0
        for h in msg.response_headers.headers.headers:
            if h.key == ":status":
                self.status = int(h.raw_value or b"0")
                break

    def on_body(self, chunk: bytes) -> None:
        if self.store_tenant:
            if self.stored is None:
                self.stored = StoredId()
            self.stored.feed(chunk)
        tail = self.tail
        tail += chunk
        if len(tail) > TAIL_BYTES:
            del tail[: len(tail) - TAIL_BYTES]

    def read_usage(self) -> None:
        """The last usage in the kept tail: a JSON completion's, or the final SSE chunk's."""
        if not self.tail:
            return
        prompt = list(_PROMPT.finditer(self.tail))
        cached = list(_CACHED.finditer(self.tail))
        if prompt:
            self.prompt_tokens = int(prompt[-1].group(1))
            # An engine that found nothing cached may omit the details (cached = 0).
            self.cached_tokens = int(cached[-1].group(1)) if cached else 0
        self.tail = bytearray()


class Observer:
    """Turns finished observations into passive health reports and ledger entries."""

    def __init__(
        self,
        fleet: FleetState,
        outliers: OutlierDetector,
        homes: ResponseHomes | None = None,
        sharing: HomeSink | None = None,
        usage_capture: bool = True,
    ) -> None:
        """``homes``: where stored responses' pods are remembered; ``sharing``: the
        other replicas, told too; ``usage_capture``: bodies seen only for their id
        (Responses answers, capture off) give no usage."""
        self.fleet = fleet
        self.outliers = outliers
        self.homes = homes
        self.sharing = sharing
        self.usage_capture = usage_capture
        self.ledger = Ledger()
        self._by_address: dict[str, int] = {}
        self._seen = -1  # the fleet's membership version _by_address was built at

    def slot_at(self, address: str) -> int | None:
        """The slot of the member pod at ``ip:port`` (pods given by hostname never match)."""
        fleet = self.fleet
        if self._seen != fleet.version:
            self._seen = fleet.version
            self._by_address = {
                p.address: slot for slot, p in enumerate(fleet.pods) if fleet.is_member(slot)
            }
        return self._by_address.get(address)

    def pod_at(self, address: str) -> str:
        """The name of the member pod at ``ip:port``, or ""."""
        slot = self.slot_at(address) if address else None
        return self.fleet.pods[slot].key if slot is not None else ""

    def _answered(self, obs: Observation, pinned: int | None) -> int | None:
        """The slot of the pod that answered: the upstream's address, else (none
        reported) the pin."""
        if obs.upstream:
            return self.slot_at(obs.upstream)
        return pinned if obs.status else None

    def record(self, obs: Observation) -> None:
        """A response as Envoy's access log reported it: passive health, and the
        ledger's counts (its usage, if any, is ``finish``'s to add)."""
        fleet = self.fleet
        pinned = fleet.slot_of(obs.pinned) if obs.pinned else None
        answered = self._answered(obs, pinned)
        if obs.status and obs.action not in CLIENT_FAULTS:
            outliers = self.outliers
            faulted = bool(obs.flags & POD_FAULTS)
            if answered is not None:
                if obs.status < 500:
                    outliers.success(answered)
                elif faulted:  # no answer of its own: unreachable, reset, timed out
                    outliers.failure(answered, 0)
                elif not obs.flags:  # the pod's own 5xx
                    outliers.failure(answered, obs.status)
            # Envoy retried away from the pin: another pod answered after more than one
            # attempt (one attempt elsewhere means Envoy never tried the pin, as for a
            # host it does not know yet), or a host not known here failed.
            away = (answered is not None and obs.attempts != 1) or (faulted and answered is None)
            if pinned is not None and pinned != answered and away:
                outliers.failure(pinned, 0)
        if obs.lora_pick and pinned is not None:
            # Its adapter, counted on the pinned pod, is freed there (routing/lora.py).
            fleet.load[pinned].lora.answered(obs.lora_pick)
        pod_key = fleet.pods[answered].key if answered is not None else None
        self.ledger.add(obs, pod_key)

    def on_body(self, obs: Observation, chunk: bytes) -> None:
        """A chunk of a response the observe filter sees. A stored answer's id is noted
        as soon as the chunk tells it, not at the body's end: the client may send the
        next turn the moment it has read this one."""
        obs.on_body(chunk)
        if obs.stored is not None and not obs.remembered:
            self._remember(obs, obs.stored.ready())

    def finish(self, obs: Observation) -> None:
        """A response the observe filter saw to its end: its usage, as the access log
        reports the response itself; and a stored Responses answer's id, remembered
        with the pod that answered, if not already."""
        if obs.stored is not None and not obs.remembered:
            self._remember(obs, obs.stored.result())
        if obs.store_tenant and not obs.remembered and self.homes is not None:
            self.homes.settle(obs.store_tenant)  # no id to note: awaited no longer
        if not self.usage_capture:
            return
        obs.read_usage()
        if obs.cached_tokens is not None:
            self.ledger.add_usage(obs, self._pod_key(obs))

    def _pod_key(self, obs: Observation) -> str | None:
        fleet = self.fleet
        answered = self._answered(obs, fleet.slot_of(obs.pinned) if obs.pinned else None)
        return fleet.pods[answered].key if answered is not None else None

    def _remember(self, obs: Observation, response_id: str | None) -> None:
        # Only a success is stored by the engine; only a pod known here can be pinned.
        if self.homes is None or response_id is None or obs.status != 200:
            return
        pod_key = self._pod_key(obs)
        if pod_key is None:
            return
        obs.remembered = True
        self.homes.remember(obs.store_tenant, response_id, pod_key)
        if self.sharing is not None:  # queued for the other replicas; no I/O here
            self.sharing.note_home(obs.store_tenant, response_id, pod_key)
