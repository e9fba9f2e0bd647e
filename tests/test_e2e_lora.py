"""LoRA adapters through real Envoy: the router's view of each pod's adapter slots
(routing/lora.py), read from its own /metrics while simulated pods serve adapters. A
pick marks its adapter loaded and in use; Envoy's access log reporting the answer frees
it, without waiting for the next scrape of the pod."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.test_e2e import Client, options, running
from tests.test_e2e_metrics import Samples, value, wait_for

pytestmark = pytest.mark.envoy

BASE = "sim-llama"
LORA = ["--enable-lora", "--max-loras", "2", "--lora-modules", "sql=/a", "chat=/b"]


INTERVAL_S = 3.0


@pytest.fixture(scope="module")
def stack() -> Iterator[Client]:
    # One pod, read every 3 s (not sooner, not later): between two scrapes only the
    # access log can say that a request has finished.
    router = {"scrape_interval_s": INTERVAL_S, "scrape_max_engine_share": 0}
    opts = options(router=router)
    opts.pods = 1
    opts.sim_args = [*opts.sim_args, *LORA]
    with running(opts) as client:
        yield client


def adapters(samples: Samples, state: str) -> float:
    return value(samples, "ace_pod_lora_adapters", state=state)


def chat(stack: Client, model: str) -> str:
    """Sends a chat to ``model``; returns what the trace header says its adapter needed
    on the pod it was pinned to and how many of its slots other adapters held ("" where
    the trace names none)."""
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "q" * 400}]}
    status, headers, _ = stack.run(stack._post("/v1/chat/completions", body))
    assert status == 200
    fields = dict(f.split("=", 1) for f in headers["x-ace-trace-prefix-kv-cache"].split(","))
    if "adapter" not in fields:
        return ""
    return f"{fields['adapter']} {fields['adapter_slots_busy']}"


def test_an_answer_frees_its_adapter_before_the_next_scrape(stack: Client) -> None:
    # vLLM shows its slots once it has served a request; the router reads them then.
    assert chat(stack, BASE) == ""
    samples = wait_for(stack, lambda s: value(s, "ace_pod_lora_slots") == 2, 3 * INTERVAL_S)
    assert value(samples, "ace_pod_lora_slots") == 2
    assert adapters(samples, "loaded") == 0  # a base-model request is no adapter's
    # Just after a scrape: the next is INTERVAL_S away.
    scrapes = value(samples, "ace_pod_scrapes_total")
    samples = wait_for(stack, lambda s: value(s, "ace_pod_scrapes_total") > scrapes, 2 * INTERVAL_S)
    scrapes = value(samples, "ace_pod_scrapes_total")
    assert chat(stack, "sql") == "load 0/2"  # the trace says what the router saw: free slots
    # The pick marked "sql" loaded and in use; its answer, as Envoy's access log reports
    # it (flushed every 0.1 s), takes it out of use, before any scrape could.
    samples = wait_for(stack, lambda s: adapters(s, "loaded") == 1 and not adapters(s, "in_use"))
    assert value(samples, "ace_pod_scrapes_total") == scrapes, "a scrape came first: too slow"
    assert (adapters(samples, "loaded"), adapters(samples, "in_use")) == (1, 0)
    assert chat(stack, "sql") == "loaded 0/2"  # still in its slot: the next one loads nothing
