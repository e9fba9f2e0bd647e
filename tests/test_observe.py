"""What ace-extproc makes of responses: usage read from JSON and SSE tails (the
observe-only filter, usage capture), passive health reported to the outlier detector
and the ledger by mode and pod (Envoy's access log), the two reports never counting a
response twice; and, through the real Envoy, a pod that died taken out by its
responses alone, the ledger counting them, with usage capture off."""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp
import pytest
from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from prometheus_client.parser import text_string_to_metric_families

from ace_extproc.access_log import observation
from ace_extproc.config import PassiveHealth, sim_fleet
from ace_extproc.observe import Observation, Observer
from ace_extproc.routing import FleetState
from ace_extproc.routing.homes import ResponseHomes
from ace_extproc.routing.outlier import OutlierDetector
from tests.conftest import put_fields
from tests.test_access_log import entry
from tests.test_e2e import Client, conversation, options, running


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


def headers_message(status: int, upstream: str, **ace: str | int) -> ProcessingRequest:
    """What the observe filter (usage capture) gets first: the response headers."""
    msg = ProcessingRequest(observability_mode=True)
    h = msg.response_headers.headers.headers.add()
    h.key, h.raw_value = ":status", str(status).encode()
    put_fields(msg.metadata_context.filter_metadata["ace"].fields, ace)
    attrs = msg.attributes["envoy.filters.http.ext_proc"].fields
    attrs["upstream.address"].string_value = upstream
    return msg


def logged(status: int, upstream: str, *, flags: int = 0, **ace: str | int) -> HTTPAccessLogEntry:
    """Envoy's access-log entry; by default a 503 is Envoy failing to connect (UF), as
    the observe filter's tests had it; ``flags`` 128 is its circuit breaker (UO)."""
    names = {32: ("upstream_connection_failure",), 128: ("upstream_overflow",), 0: ()}
    ok = ace.pop("ok", 0)
    if status == 503 and not flags and not ok:
        flags = 32
    return entry(status, upstream, flags=names[flags], **ace)


@pytest.fixture
def observer() -> Observer:
    fleet = FleetState(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(3)]))
    health = PassiveHealth(
        consecutive_5xx=2, consecutive_gateway_failure=2, max_ejection_percent=100
    )
    return Observer(fleet, OutlierDetector(fleet, health, schedule=lambda _s, _f: None))


def observe(observer: Observer, log_entry: HTTPAccessLogEntry) -> None:
    """One response as the access log reports it."""
    obs = observation(log_entry)
    assert obs is not None
    observer.record(obs)


def test_a_pod_that_fails_twice_is_taken_out_and_retried_away_from(observer: Observer) -> None:
    fleet = observer.fleet
    pod0, pod1 = fleet.pods[0], fleet.pods[1]
    # Envoy could not reach pod 0 (503 UF): one failure, not yet out.
    observe(observer, logged(503, pod0.address, mode="prod", served_by=pod0.key))
    assert fleet.available & 1
    # Pinned to pod 0, answered by pod 1 after a retry: pod 0 failed again; pod 1 is fine.
    retried = logged(200, pod1.address, mode="prod", served_by=pod0.key)
    retried.common_properties.upstream_request_attempt_count = 2
    observe(observer, retried)
    assert not fleet.available & 1 and fleet.available & 0b10
    totals = observer.ledger.by_mode["prod"]
    assert (totals.responses, totals.failed) == (2, 1)
    assert observer.ledger.by_pod[pod1.key].responses == 1


def test_a_success_resets_the_count_and_envoys_own_refusals_count_nothing(
    observer: Observer,
) -> None:
    fleet = observer.fleet
    pod = fleet.pods[2]
    observe(observer, logged(503, pod.address, mode="shadow"))
    observe(observer, logged(200, pod.address, mode="shadow"))
    observe(observer, logged(503, pod.address, mode="shadow"))
    assert fleet.available & 0b100  # never two failures in a row
    overflow = logged(503, pod.address, mode="shadow", flags=128)
    observe(observer, overflow)  # UO: Envoy's circuit breaker, not the pod
    assert fleet.available & 0b100
    engine_500 = logged(500, pod.address, mode="shadow", ok=1)  # flags 0: the pod
    observe(observer, engine_500)
    assert not fleet.available & 0b100


def test_answers_to_bodies_the_router_found_malformed_count_nothing(observer: Observer) -> None:
    """A body nested 10,000 deep makes vLLM's own JSON parser fail with a 500: a client
    could take pods out at will, were those answers held against the pod."""
    fleet = observer.fleet
    pod = fleet.pods[1]
    for action in ("bypass_bad_json", "bypass_invalid_body", "reject_not_object"):
        for _ in range(3):
            observe(observer, logged(500, pod.address, mode="prod", action=action, ok=1))
    assert fleet.available & 0b10
    for _ in range(2):  # the same answers to a request it routed: the pod's doing
        observe(observer, logged(500, pod.address, mode="prod", action="miss", ok=1))
    assert not fleet.available & 0b10


def test_estimates_and_engine_reports_add_up_by_mode(observer: Observer) -> None:
    """The access log counts each response and its estimate; the observe filter (usage
    capture) adds the engine's usage of the same responses, never the response again,
    whichever arrives first."""
    pod = observer.fleet.pods[0]
    for i, cached in enumerate((0, 512, 1024)):
        obs = Observation()
        obs.on_headers(headers_message(200, pod.address, mode="shadow", saved_tokens=500))
        obs.on_body(usage_json(2000, cached))
        if i % 2:
            observer.finish(obs)
        observe(observer, logged(200, pod.address, mode="shadow", saved_tokens=500))
        if not i % 2:
            observer.finish(obs)
    t = observer.ledger.by_mode["shadow"]
    assert (t.responses, t.with_usage, t.prompt_tokens) == (3, 3, 6000)
    assert (t.cached_tokens, t.estimated_saved_tokens) == (1536, 1500)
    assert t.estimated_saved_with_usage == 1500
    by_pod = observer.ledger.by_pod[pod.key]
    assert (by_pod.responses, by_pod.with_usage, by_pod.cached_tokens) == (3, 3, 1536)
    # A body without usage (an error) adds nothing; nor does the filter's 5xx.
    error = Observation()
    error.on_headers(headers_message(500, pod.address, mode="shadow"))
    error.on_body(b'{"error": {"message": "boom"}}')
    observer.finish(error)
    assert (t.responses, t.failed, t.with_usage) == (3, 0, 3)


def test_the_estimate_is_counted_in_the_engines_tokens(observer: Observer) -> None:
    """The router counts prompt bytes / bytes_per_token; the engine its tokenizer's. The
    estimate for a response joins the engine's count as the same share of its prompt."""
    pod = observer.fleet.pods[0]
    obs = Observation()
    ace = {"mode": "shadow", "saved_tokens": 500, "prompt_tokens": 1000}
    obs.on_headers(headers_message(200, pod.address, **ace))  # half the prompt, it says
    obs.on_body(usage_json(1600, 768))  # a tokenizer that counts 1.6 tokens to its one
    observer.finish(obs)
    t = observer.ledger.by_mode["shadow"]
    assert (t.prompt_tokens, t.cached_tokens, t.estimated_saved_with_usage) == (1600, 768, 800)


class Homes:
    """What the observer tells the other replicas (replicas.ReplicaSync.note_home)."""

    def __init__(self) -> None:
        self.noted: list[tuple[str, str, str]] = []

    def note_home(self, tenant: str, response_id: str, pod: str) -> None:
        self.noted.append((tenant, response_id, pod))


def responses_answer(response_id: str, prompt: int, cached: int) -> bytes:
    usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}}
    return json.dumps({"id": response_id, "object": "response", "usage": usage}).encode()


@pytest.mark.parametrize("usage_capture", [False, True])
def test_a_stored_response_is_remembered_with_the_pod_that_answered(usage_capture: bool) -> None:
    """The routing filter marks the answers the engine is asked to store (store_tenant);
    their id and the pod that answered are remembered and told to the other replicas.
    Their usage (input_tokens) counts only where usage capture is on."""
    fleet = FleetState(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(3)]))
    homes, shared = ResponseHomes(fleet), Homes()
    outliers = OutlierDetector(fleet, PassiveHealth(), schedule=lambda _s, _f: None)
    observer = Observer(fleet, outliers, homes, shared, usage_capture)
    pod = fleet.pods[1]
    for status, rid, tenant in ((200, "resp_1", "acme"), (404, "resp_2", "acme"), (200, "x", "")):
        obs = Observation()
        ace: dict[str, str | int] = {"mode": "prod", "store_tenant": tenant} if tenant else {}
        obs.on_headers(headers_message(status, pod.address, **ace))
        answer = responses_answer(rid, 900, 640)
        observer.on_body(obs, answer[:30])
        # Noted from the first chunk: the next turn may come before the body's end.
        assert (homes.find("acme", rid).result == "pinned") == (status == 200 and bool(tenant))
        observer.on_body(obs, answer[30:])
        observer.finish(obs)
    # Only the success of a marked answer: an error stored nothing, unmarked is not ours.
    assert shared.noted == [("acme", "resp_1", pod.key)]
    assert homes.find("acme", "resp_1").slot == 1 and len(homes) == 1
    totals = observer.ledger.by_mode.get("prod")
    if usage_capture:
        assert totals is not None and (totals.prompt_tokens, totals.cached_tokens) == (1800, 1280)
    else:
        assert totals is None


@pytest.mark.envoy
@pytest.mark.parametrize("upstream_mode", ["endpoint", "cluster"])
def test_passive_health_alone_takes_a_dead_pod_out_through_envoy(upstream_mode: str) -> None:
    """No probes, no scrapes, no usage capture: only the responses Envoy's access log
    reports. The requests pinned to the dead pod are retried elsewhere (endpoint mode:
    their fallback; cluster mode: the pod cluster's standby pods), status 200; five of
    those in a row (Envoy's outlier detection's consecutive gateway failures) take the
    pod out of picking. The ledger counts every response, none failed."""
    router = {"probe_interval_s": 3600.0, "scrape_interval_s": 0.0}
    with running(options(upstream_mode=upstream_mode, router=router)) as client:
        rendered = (client.stack.workdir / "envoy.yaml").read_text()
        assert "envoy.access_loggers.http_grpc" in rendered
        # The observe filter is there for the Responses API's path alone (its ids).
        assert rendered.count("disabled: true") == 1
        status, headers, _ = client.chat(conversation(0, "passive"))
        assert status == 200
        home = headers["x-ace-served-by"].split("/")[1]
        before = responses(client, at_least=2)  # the stack's own request, and that one
        client.run(client.stack.stop_process(home, signal.SIGKILL))
        named = []
        for turn in range(1, 13):
            status, headers, _ = client.chat(conversation(turn, "passive"))
            assert status == 200  # retried elsewhere, never lost
            assert headers["x-sim-pod"] != home
            named.append(headers["x-ace-pinned"].split("/")[1])
            # Envoy sends its entries every 0.1 s: pace the requests past that, so the
            # count below is the detector's, not the batching's.
            client.run(asyncio.sleep(0.3))
        # Allow one request of lag all the same (a busy machine).
        assert 5 <= named.count(home) <= 6, named
        assert home not in named[7:]
        after = responses(client, at_least=before[0] + 12)
        assert (after[0] - before[0], after[1] - before[1]) == (12, 0)


def responses(client: Client, at_least: float) -> tuple[float, float]:
    """ace-extproc's ledger from its /metrics: responses and failed responses in prod,
    once at least ``at_least`` responses are in (Envoy's batches arrive within 0.1 s)."""

    async def get() -> str:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://{client.stack.options.metrics}/metrics") as resp,
        ):
            return await resp.text()

    for _ in range(50):
        found = {"ace_responses_total": 0.0, "ace_responses_failed_total": 0.0}
        for family in text_string_to_metric_families(client.run(get())):
            for sample in family.samples:
                if sample.name in found and sample.labels.get("mode") == "prod":
                    found[sample.name] += sample.value
        if found["ace_responses_total"] >= at_least:
            break
        client.run(asyncio.sleep(0.1))
    return found["ace_responses_total"], found["ace_responses_failed_total"]
