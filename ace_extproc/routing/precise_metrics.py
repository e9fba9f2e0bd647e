"""Precise routing's metrics: each followed pod's event stream (state, lag, gaps,
replays, bad frames) and view, and each destination's tokenizer. Registered beside
``Telemetry`` on the same registry (``app.py``). Scrapes run on the metrics server's
thread, so this only reads."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ace_extproc.routing.kv_events import STATES, KvEvents
from ace_extproc.routing.precise_routing import PreciseRouting


class PreciseMetrics(Collector):
    def __init__(self, events: KvEvents | None, routing: PreciseRouting) -> None:
        self.events, self.routing = events, routing

    def collect(self) -> Iterator[Metric]:
        if self.events is not None:
            yield from self._stream_families(self.events)
        yield from self._routing_families(self.routing)

    def _stream_families(self, events: KvEvents) -> Iterator[Metric]:
        pod = ["pod"]
        state = GaugeMetricFamily(
            "ace_kv_events_state",
            "1 for the pod's KV event state: precise (its events trusted), connecting, "
            "uncertain (events lost, not yet recovered), mismatch (block size), off.",
            labels=["pod", "state"],
        )
        lag = GaugeMetricFamily(
            "ace_kv_events_lag_seconds", "The last batch's age on arrival.", labels=pod
        )
        held = GaugeMetricFamily(
            "ace_kv_events_blocks", "Blocks the pod's events say it holds.", labels=pod
        )
        counters = {
            name: CounterMetricFamily(f"ace_kv_events_{name}", doc, labels=pod)
            for name, doc in (
                ("batches", "Event batches applied."),
                ("gaps", "Sequence gaps seen."),
                ("replays", "Replays asked of the engine after a gap or reconnect."),
                ("replayed", "Replays that covered what was missed."),
                ("bad_frames", "Frames that were not an event batch."),
                ("skipped_events", "Events not understood (unknown type or shape)."),
                ("restarts", "Event sequences that began again (engine restarts)."),
                ("disconnects", "Times the stream dropped."),
            )
        }
        index = events.index
        for stream in events.streams.values():
            now = stream.stats.state  # read only: the scrape runs on its own thread
            for name in STATES:
                state.add_metric([stream.name, name], 1.0 if name == now else 0.0)
            stats = stream.stats
            lag.add_metric([stream.name], stats.lag_s)
            held.add_metric([stream.name], index.blocks_held(stream.slot))
            for name, family in counters.items():
                family.add_metric([stream.name], getattr(stats, name))
        yield from (state, lag, held, *counters.values())
        speculative = CounterMetricFamily(
            "ace_precise_speculative",
            "Picks recorded ahead of the engine's events, by what became of them.",
            labels=["result"],
        )
        speculative.add_metric(["confirmed"], index.confirmed)
        speculative.add_metric(["expired"], index.expired)
        yield speculative
        yield CounterMetricFamily(
            "ace_precise_doomed_blocks",
            "Blocks a match did not count: a pick still queued on the pod pushed them out "
            "of its recency order, so the engine evicts them before the request is in.",
            value=index.doomed_blocks,
        )

    def _routing_families(self, routing: PreciseRouting) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "ace_precise_requests",
            "Requests with a live event-publishing candidate: keyed token-exact; deferred "
            "(a long new document tokenized aside meanwhile); or unkeyed (a body or "
            "template the tokenizer does not render). Both routed approximately.",
            labels=["result"],
        )
        deferred = sum(getattr(t, "deferred", 0) for t in routing.tokenizers.values())
        requests.add_metric(["keyed"], routing.views)
        requests.add_metric(["deferred"], deferred)
        requests.add_metric(["unkeyed"], routing.unkeyed - deferred)
        yield requests
        agreement = CounterMetricFamily(
            "ace_precise_guess_picks",
            "Keyed requests by whether the approximate index, alone, guessed the same "
            "deepest pods as the events say (same: it would have steered alike).",
            labels=["agreement"],
        )
        agreement.add_metric(["same"], routing.guess_agreed)
        agreement.add_metric(["differs"], routing.guess_differed)
        blocks = CounterMetricFamily(
            "ace_precise_guess_blocks",
            "Blocks (the approximate index's) that only one side says a candidate holds: "
            "guess_only (evicted, or not yet computed), events_only (placed by another "
            "replica or gateway, or kept past the guess's LRU).",
            labels=["side"],
        )
        blocks.add_metric(["guess_only"], routing.guess_only_blocks)
        blocks.add_metric(["events_only"], routing.events_only_blocks)
        yield from (agreement, blocks)
        loaded = GaugeMetricFamily(
            "ace_tokenizer_loaded",
            "1 if the destination's tokenizer loaded; 0: routed approximately.",
            labels=["destination"],
        )
        for destination in routing.tokenizers:
            loaded.add_metric([destination], 1.0)
        for destination in routing.failed:
            loaded.add_metric([destination], 0.0)
        raised = CounterMetricFamily(
            "ace_tokenizer_failures",
            "Requests or pieces the destination's loaded tokenizer raised on (each "
            "routed approximately; a piece that failed is not tried again).",
            labels=["destination"],
        )
        for destination, tokenizer in routing.tokenizers.items():
            raised.add_metric([destination], getattr(tokenizer, "pieces_failed", 0))
        yield from (loaded, raised)
