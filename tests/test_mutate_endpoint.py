"""Envoy's answers in endpoint mode (``router.upstream_mode: endpoint``): ``ip:port``
lists in ``x-ace-upstream`` and the Gateway API Inference Extension's header and
``envoy.lb`` metadata; cluster mode's answers unchanged."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    CommonResponse,
    ProcessingResponse,
)

from ace_extproc import envoy_config, mutate
from ace_extproc.config import Config, Destination, Fleet, Mode, Pod, Settings, sim_fleet
from ace_extproc.processor import Outcome
from ace_extproc.routing import BlockIndex, FleetState, Pick, PrefixAffinityPicker, RoutingRequest
from tests.conftest import make_processor

FLEET = sim_fleet([f"10.0.0.{i + 1}:8000" for i in range(4)])
PODS = FLEET.pods
GIE = "x-gateway-destination-endpoint"


def _headers(common: CommonResponse) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}


def _metadata(resp: ProcessingResponse) -> dict[str, dict[str, Any]]:
    return {
        ns: {k: v.string_value for k, v in value.struct_value.fields.items()}
        for ns, value in resp.dynamic_metadata.fields.items()
    }


def pinned(endpoint: bool, fallbacks: tuple[Pod, ...] = (), body: bytes | None = b"{}") -> Outcome:
    return Outcome(
        Mode.PROD,
        "hit",
        "0123456789abcdef",
        pod=PODS[1],
        would_pick=PODS[1],
        body=body,
        fallbacks=fallbacks,
        endpoint=endpoint,
    )


def test_the_header_metadata_and_destination_name_the_pod_and_its_fallbacks() -> None:
    resp = mutate.body_decided(pinned(True, (PODS[2], PODS[0])), False)
    common = resp.request_body.response
    listed = "10.0.0.2:8000,10.0.0.3:8000,10.0.0.1:8000"
    assert _headers(common) == {
        "x-ace-upstream": listed,
        GIE: listed,
        "x-ace-destination": "ace_default.sim",
        "content-length": "2",
    }
    assert common.clear_route_cache
    assert common.body_mutation.body == b"{}"
    meta = _metadata(resp)
    # GIE's protocol: the same value in the header and in envoy.lb metadata.
    assert meta["envoy.lb"] == {GIE: listed}
    assert meta["ace"]["served_by"] == "sim/pod-1"


def test_without_fallbacks_one_endpoint_and_no_duplicate_of_the_primary() -> None:
    alone = mutate.body_decided(pinned(True), False)
    assert _headers(alone.request_body.response)["x-ace-upstream"] == "10.0.0.2:8000"
    assert _metadata(alone)["envoy.lb"] == {GIE: "10.0.0.2:8000"}
    doubled = mutate.body_decided(pinned(True, (PODS[1], PODS[3])), False)
    assert _headers(doubled.request_body.response)[GIE] == "10.0.0.2:8000,10.0.0.4:8000"


def test_header_and_duplex_answers_carry_the_same() -> None:
    decided = mutate.headers_decided(pinned(True, (PODS[3],), body=None), False)
    assert _headers(decided.request_headers.response)[GIE] == "10.0.0.2:8000,10.0.0.4:8000"
    assert _metadata(decided)["envoy.lb"] == {GIE: "10.0.0.2:8000,10.0.0.4:8000"}
    first, *chunks = mutate.duplex_decided(pinned(True, (PODS[3],)), False, b"{}")
    assert _headers(first.request_headers.response)["x-ace-upstream"] == (
        "10.0.0.2:8000,10.0.0.4:8000"
    )
    assert _metadata(first)["envoy.lb"] == {GIE: "10.0.0.2:8000,10.0.0.4:8000"}
    assert [c.request_body.response.body_mutation.streamed_response.body for c in chunks] == [b"{}"]


def test_ipv6_pods_are_bracketed_as_envoy_names_them() -> None:
    pod = Pod("v6", "a", "fd00:0:0::7", 8000)
    outcome = Outcome(Mode.PROD, "miss", pod=pod, body=None, endpoint=True)
    assert mutate.endpoints(outcome) == "[fd00::7]:8000"


def test_cluster_mode_is_unchanged() -> None:
    resp = mutate.body_decided(pinned(False, (PODS[2],)), False)
    common = resp.request_body.response
    assert _headers(common) == {"x-ace-upstream": "ace_pod.sim.pod-1", "content-length": "2"}
    assert common.clear_route_cache
    assert set(_metadata(resp)) == {"ace"}


@pytest.mark.parametrize("endpoint", [False, True])
def test_no_pod_names_nothing(endpoint: bool) -> None:
    """Shadow, bypasses: nothing pinned, so Envoy's fallback policy picks (fail-open)."""
    outcome = Outcome(Mode.SHADOW, "hit", would_pick=PODS[0], endpoint=endpoint)
    resp = mutate.body_decided(outcome, False)
    assert not resp.request_body.response.header_mutation.set_headers
    assert set(_metadata(resp)) == {"ace"}


def test_names_agree_with_the_envoy_config() -> None:
    assert mutate.GIE_HEADER == envoy_config.GIE_HEADER
    assert mutate.GIE_NAMESPACE == envoy_config.GIE_NAMESPACE
    assert mutate.DESTINATION_HEADER == envoy_config.DESTINATION_HEADER
    assert envoy_config.GIE_NAMESPACE in envoy_config.METADATA_NAMESPACES
    two = Fleet(
        (
            Destination("a", "vllm", "http://10.0.0.1:1", (Pod("a", "p", "10.0.0.1", 1),)),
            Destination("b", "vllm", "http://10.0.1.1:1", (Pod("b", "q", "10.0.1.1", 1),)),
        )
    )
    for dest in two.destinations:
        outcome = Outcome(Mode.PROD, "miss", pod=dest.pods[0], endpoint=True)
        answer = mutate.body_decided(outcome, False)
        assert _headers(answer.request_body.response)["x-ace-destination"] == dest.cluster


# ---------------------------------------------------------------- from the processor


class _NextSlotFallbacks:
    """Prefix affinity, plus the next two slots as fallbacks (the cost picker's role)."""

    def __init__(self, fleet: FleetState, index: BlockIndex) -> None:
        self.inner = PrefixAffinityPicker(fleet, index)
        self.n = len(fleet.pods)

    def pick(self, request: RoutingRequest, candidates: int) -> Pick | None:
        pick = self.inner.pick(request, candidates)
        if pick is None:
            return None
        fallbacks = tuple((pick.slot + k) % self.n for k in (1, 2))
        return Pick(pick.pod, pick.slot, pick.matched_blocks, pick.action, fallbacks)


BODY = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]})
HEADERS = {":path": "/v1/chat/completions", ":method": "POST", "content-type": "application/json"}


@pytest.mark.parametrize("upstream_mode", ["cluster", "endpoint"])
def test_processor_fills_fallbacks_and_the_mode_when_pinning(upstream_mode: str) -> None:
    settings = Settings(salt_secret=b"s", upstream_mode=upstream_mode)
    proc = make_processor(Config(FLEET, settings), picker=_NextSlotFallbacks)
    outcome = proc.on_body(proc.on_headers(HEADERS, False), BODY)
    assert outcome.pod is not None
    slot = PODS.index(outcome.pod)
    assert outcome.fallbacks == (PODS[(slot + 1) % 4], PODS[(slot + 2) % 4])
    assert outcome.endpoint is (upstream_mode == "endpoint")
    value = _headers(mutate.body_decided(outcome, False).request_body.response)["x-ace-upstream"]
    if upstream_mode == "endpoint":
        assert value.split(",") == [p.address for p in (outcome.pod, *outcome.fallbacks)]
    else:
        assert value == outcome.pod.cluster


def test_shadow_pins_nothing_in_endpoint_mode() -> None:
    settings = Settings(salt_secret=b"s", upstream_mode="endpoint", mode=Mode.SHADOW)
    proc = make_processor(Config(FLEET, settings), picker=_NextSlotFallbacks)
    outcome = proc.on_body(proc.on_headers(HEADERS, False), BODY)
    assert outcome.pod is None and outcome.fallbacks == () and not outcome.endpoint
