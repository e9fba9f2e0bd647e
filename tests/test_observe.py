"""What the observe-only filter makes of responses: usage read from JSON and SSE
tails, passive health reported to the outlier detector, the ledger by mode and pod;
and, through the real Envoy, a pod that died taken out by its responses alone."""

from __future__ import annotations

import json
import signal

import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from ace_extproc.config import PassiveHealth, sim_fleet
from ace_extproc.observe import Observation, Observer
from ace_extproc.routing import FleetState
from ace_extproc.routing.outlier import OutlierDetector
from tests.test_e2e import conversation, options, running


def usage_json(prompt: int, cached: int | None) -> bytes:
    usage: dict[str, object] = {"prompt_tokens": prompt, "completion_tokens": 4}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    body = {"choices": [{"message": {"content": 'say "cached_tokens":999'}}], "usage": usage}
    return json.dumps(body).encode()


def test_usage_from_a_json_completion() -> None:
    obs = Observation()
    body = usage_json(900, 640)
    obs.on_body(body[:50])
    obs.on_body(body[50:])
    obs.read_usage()
    assert (obs.prompt_tokens, obs.cached_tokens) == (900, 640)  # not the quoted 999


def test_usage_from_the_last_sse_chunk_split_across_body_chunks() -> None:
    events = [b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n'] * 400
    events.append(b"data: " + usage_json(2048, 1536) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    stream = b"".join(events)
    obs = Observation()
    for start in range(0, len(stream), 97):  # odd chunking splits the usage chunk
        obs.on_body(stream[start : start + 97])
    assert len(obs.tail) <= 8192
    obs.read_usage()
    assert (obs.prompt_tokens, obs.cached_tokens) == (2048, 1536)


def test_no_usage_or_no_details() -> None:
    none = Observation()
    none.on_body(b'{"error": {"message": "boom"}}')
    none.read_usage()
    assert none.cached_tokens is None
    bare = Observation()
    bare.on_body(usage_json(100, None))
    bare.read_usage()
    assert (bare.prompt_tokens, bare.cached_tokens) == (100, 0)


def headers_message(status: int, upstream: str, **ace: object) -> ProcessingRequest:
    msg = ProcessingRequest(observability_mode=True)
    h = msg.response_headers.headers.headers.add()
    h.key, h.raw_value = ":status", str(status).encode()
    fields = msg.metadata_context.filter_metadata["ace"].fields
    for key, value in ace.items():
        if isinstance(value, str):
            fields[key].string_value = value
        else:
            assert isinstance(value, int)
            fields[key].number_value = value
    attrs = msg.attributes["envoy.filters.http.ext_proc"].fields
    attrs["upstream.address"].string_value = upstream
    attrs["response.flags"].number_value = 32 if status == 503 and not ace.get("ok") else 0
    return msg


@pytest.fixture
def observer() -> Observer:
    fleet = FleetState(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(3)]))
    health = PassiveHealth(
        consecutive_5xx=2, consecutive_gateway_failure=2, max_ejection_percent=100
    )
    return Observer(fleet, OutlierDetector(fleet, health, schedule=lambda _s, _f: None))


def observe(observer: Observer, msg: ProcessingRequest) -> None:
    obs = Observation()
    obs.on_headers(msg)
    observer.finish(obs)


def test_a_pod_that_fails_twice_is_taken_out_and_retried_away_from(observer: Observer) -> None:
    fleet = observer.fleet
    pod0, pod1 = fleet.pods[0], fleet.pods[1]
    # Envoy could not reach pod 0 (503 UF): one failure, not yet out.
    observe(observer, headers_message(503, pod0.address, mode="prod", served_by=pod0.key))
    assert fleet.available & 1
    # Pinned to pod 0, answered by pod 1 after a retry: pod 0 failed again; pod 1 is fine.
    observe(observer, headers_message(200, pod1.address, mode="prod", served_by=pod0.key))
    assert not fleet.available & 1 and fleet.available & 0b10
    totals = observer.ledger.by_mode["prod"]
    assert (totals.responses, totals.failed) == (2, 1)
    assert observer.ledger.by_pod[pod1.key].responses == 1


def test_a_success_resets_the_count_and_envoys_own_refusals_count_nothing(
    observer: Observer,
) -> None:
    fleet = observer.fleet
    pod = fleet.pods[2]
    observe(observer, headers_message(503, pod.address, mode="shadow"))
    observe(observer, headers_message(200, pod.address, mode="shadow"))
    observe(observer, headers_message(503, pod.address, mode="shadow"))
    assert fleet.available & 0b100  # never two failures in a row
    overflow = headers_message(503, pod.address, mode="shadow", ok=1)
    overflow.attributes["envoy.filters.http.ext_proc"].fields["response.flags"].number_value = 128
    observe(observer, overflow)  # UO: Envoy's circuit breaker, not the pod
    assert fleet.available & 0b100
    engine_500 = headers_message(500, pod.address, mode="shadow", ok=1)  # flags 0: the pod
    observe(observer, engine_500)
    assert not fleet.available & 0b100


def test_answers_to_bodies_the_router_found_malformed_count_nothing(observer: Observer) -> None:
    """A body nested 10,000 deep makes vLLM's own JSON parser fail with a 500: a client
    could take pods out at will, were those answers held against the pod."""
    fleet = observer.fleet
    pod = fleet.pods[1]
    for action in ("bypass_bad_json", "bypass_invalid_body", "reject_not_object"):
        for _ in range(3):
            observe(observer, headers_message(500, pod.address, mode="prod", action=action, ok=1))
    assert fleet.available & 0b10
    for _ in range(2):  # the same answers to a request it routed: the pod's doing
        observe(observer, headers_message(500, pod.address, mode="prod", action="miss", ok=1))
    assert not fleet.available & 0b10


def test_estimates_and_engine_reports_add_up_by_mode(observer: Observer) -> None:
    pod = observer.fleet.pods[0]
    for cached in (0, 512, 1024):
        obs = Observation()
        obs.on_headers(headers_message(200, pod.address, mode="shadow", saved_tokens=500))
        obs.on_body(usage_json(2000, cached))
        observer.finish(obs)
    t = observer.ledger.by_mode["shadow"]
    assert (t.responses, t.with_usage, t.prompt_tokens) == (3, 3, 6000)
    assert (t.cached_tokens, t.estimated_saved_tokens) == (1536, 1500)


@pytest.mark.envoy
def test_passive_health_alone_takes_a_dead_pod_out_through_envoy() -> None:
    """No probes, no scrapes: only the responses Envoy's observe filter reports. In
    endpoint mode the requests pinned to the dead pod are retried on their fallback
    (status 200, answered elsewhere); five of those in a row (Envoy's outlier
    detection's consecutive gateway failures) take the pod out of picking."""
    router = {"probe_interval_s": 3600.0, "scrape_interval_s": 0.0}
    with running(options(upstream_mode="endpoint", router=router)) as client:
        status, headers, _ = client.chat(conversation(0, "passive"))
        assert status == 200
        home = headers["x-ace-served-by"].split("/")[1]
        client.run(client.stack.stop_process(home, signal.SIGKILL))
        named = []
        for turn in range(1, 13):
            status, headers, _ = client.chat(conversation(turn, "passive"))
            assert status == 200  # retried on the fallback, never lost
            assert headers["x-sim-pod"] != home
            named.append(headers["x-ace-pinned"].split("/")[1])
        # Observations arrive as the client gets its answer, so allow one request of lag.
        assert 5 <= named.count(home) <= 6, named
        assert home not in named[7:]
