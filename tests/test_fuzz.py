"""The decision under fuzzed requests (tests/fuzzing.py), in process: it never raises,
and where tenants are configured no request that can reach an engine with a body
goes without its tenant's salt, or with a cache field of the client's. Thousands of
requests a second here; through Envoy, 100,000 of them: tests/test_soak.py."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from ace_extproc.config import Config, Mode, Settings, TenantConfig, sim_fleet
from ace_extproc.processor import Processor
from tests.conftest import make_processor
from tests.fuzzing import KEYS, Fuzzer


def _processor(mode: Mode) -> Processor:
    digests = {hashlib.sha256(k.encode()).digest(): t for k, t in KEYS.items()}
    tenants = TenantConfig(key_digests=digests, header="x-tenant-id")
    fleet = sim_fleet([f"127.0.0.1:{8001 + i}" for i in range(4)])
    return make_processor(Config(fleet, Settings(mode=mode, salt_secret=b"fuzz", tenants=tenants)))


def _members(body: bytes) -> list[tuple[str, Any]]:
    """The JSON object's members in order, a key given twice kept twice (an engine's
    last-wins parser takes the last)."""
    # Bytes that are not UTF-8 are never JSON's structure: replaced, they change none.
    text = body.decode("utf-8", "replace")
    decoded = json.loads(text, object_pairs_hook=lambda items: ("object", items))
    assert isinstance(decoded, tuple), "not a JSON object"
    return list(decoded[1])


@pytest.mark.parametrize("mode", list(Mode))
def test_fuzzed_requests_never_reach_an_engine_unsalted(mode: Mode) -> None:
    p = _processor(mode)
    fuzzer = Fuzzer(seed=22 + list(Mode).index(mode))
    reached = 0
    for _ in range(5000):
        r = fuzzer.request()
        headers = {":path": r.path, ":method": r.method, **r.headers}
        ctx = p.on_headers(headers, end_of_stream=not r.body)
        outcome = p.on_body(ctx, r.body) if r.body else ctx.outcome
        if outcome is None:  # a request without a body the headers did not decide
            continue
        if outcome.reject_status:
            assert outcome.reject_status in (400, 401, 413, 501), outcome
            continue
        # Any path: a JSON body that goes on is salted, routed or not.
        engine_reads_it = (
            r.body
            and r.method == "POST"
            and "json" in (r.headers.get("content-type") or "application/json").lower()
        )
        if not engine_reads_it:
            continue
        reached += 1
        assert outcome.body is not None, (outcome.action, r)
        pairs = _members(outcome.body)
        salts = [v for k, v in pairs if k == "cache_salt"]
        assert salts == [p.tenants.salt(ctx.tenant)], (outcome.action, r)
        ids = [v for k, v in pairs if k == "cache_prefix_id"]
        assert all(str(v).startswith(f"ace-kv-{ctx.tenant}-") for v in ids), r
    assert reached > 1000  # the property was tested, not skipped
