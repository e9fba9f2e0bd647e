"""Cost of recording metrics on the request path: ace_extproc.telemetry against
prometheus-client's own Counter and Histogram, in the same run.

    python -m bench.telemetry_cost [--calls 20000] [--rounds 25]

Each figure is nanoseconds per call: ``--rounds`` rounds, each timing every variant
once over ``--calls`` calls (interleaved, so a noisy neighbour hits all alike), the
best round of each, less the best round of an empty loop making a call with as many
arguments. Also
prints the scrape-time cost of one exposition (off the request path). A decision
records one ``decision`` and one ``steps_ns``; prometheus-client would need a
counter ``inc`` per decision, several more for the token counters, and four
``observe``s.
"""

from __future__ import annotations

import argparse
import logging
import platform
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from ace_extproc.config import Settings, TenantConfig, sim_fleet
from ace_extproc.routing import BlockIndex, FleetState
from ace_extproc.telemetry import BOUNDS_NS, PICK, Telemetry


def per_call_ns(body: Callable[[int], None], calls: int) -> float:
    t = time.perf_counter_ns()
    body(calls)
    return (time.perf_counter_ns() - t) / calls


def measure(calls: int = 20_000, rounds: int = 25) -> dict[str, float]:
    """ns per call of each recording method (loop overhead subtracted)."""
    fleet = FleetState(sim_fleet([f"127.0.0.1:{8001 + i}" for i in range(8)]))
    index = BlockIndex(1000)
    plain = Telemetry(Settings(), fleet, index, process_metrics=False)
    tenants = TenantConfig(header="x-tenant-id")
    labelled = Telemetry(
        Settings(metrics_tenant_label=True, tenants=tenants), fleet, index, process_metrics=False
    )
    logging.getLogger("ace_extproc.decision").setLevel(logging.INFO)  # decision lines off

    reg = CollectorRegistry()
    counter = Counter("bench_decisions", "d", ["mode", "action"], registry=reg)
    tokens = Counter("bench_tokens", "t", ["mode", "pod"], registry=reg)
    hist = Histogram("bench_step_seconds", "s", ["step"], buckets=[b / 1e9 for b in BOUNDS_NS])
    reg.register(hist)
    child = counter.labels("prod", "hit")
    hchild = hist.labels("pick")

    def noop(*args: object) -> None:
        pass

    def empty1(n: int) -> None:
        for _ in range(n):
            noop("prod")

    def empty8(n: int) -> None:
        for _ in range(n):
            noop("prod", "hit", "acme", 3, 4096, 2048, 61.5, 40_000)

    def empty4(n: int) -> None:
        for _ in range(n):
            noop(10_000, 20_000, 15_000, 5_000)

    def decision(n: int) -> None:
        d = plain.decision
        for _ in range(n):
            d("prod", "hit", "acme", 3, 4096, 2048, 61.5, 40_000)

    def decision_tenant(n: int) -> None:
        d = labelled.decision
        for _ in range(n):
            d("prod", "hit", "acme", 3, 4096, 2048, 61.5, 40_000)

    def decision_bypass(n: int) -> None:
        d = plain.decision
        for _ in range(n):
            d("prod", "bypass_unknown_path")

    def step(n: int) -> None:
        s = plain.step_ns
        for _ in range(n):
            s(PICK, 15_000)

    def steps(n: int) -> None:
        s = plain.steps_ns
        for _ in range(n):
            s(10_000, 20_000, 15_000, 5_000)

    def prom_inc_labels(n: int) -> None:
        for _ in range(n):
            counter.labels("prod", "hit").inc()

    def prom_inc_child(n: int) -> None:
        inc = child.inc
        for _ in range(n):
            inc()

    def prom_observe_labels(n: int) -> None:
        for _ in range(n):
            hist.labels("pick").observe(15e-6)

    def prom_observe_child(n: int) -> None:
        observe = hchild.observe
        for _ in range(n):
            observe(15e-6)

    def prom_decision(n: int) -> None:
        # What ``decision`` records, done with prometheus-client: the decision counter
        # and three token counters, labels looked up each time.
        for _ in range(n):
            counter.labels("prod", "hit").inc()
            tokens.labels("prod", "pod-3").inc(4096)
            tokens.labels("prod", "pod-3").inc(2048)
            tokens.labels("prod", "pod-3").inc(61.5)

    def prom_steps(n: int) -> None:
        for _ in range(n):
            hist.labels("parse").observe(10e-6)
            hist.labels("hash").observe(20e-6)
            hist.labels("pick").observe(15e-6)
            hist.labels("rewrite").observe(5e-6)

    def loop(n: int) -> None:
        for _ in range(n):
            pass

    variants: dict[str, tuple[Callable[[int], None], Callable[[int], None]]] = {
        "ace decision()  [8 args, no tenant label]": (decision, empty8),
        "ace decision()  [8 args, tenant label]": (decision_tenant, empty8),
        "ace decision()  [bypass, 2 args]": (decision_bypass, empty1),
        "ace step_ns()": (step, empty1),
        "ace steps_ns()  [all four steps]": (steps, empty4),
        "prom Counter.labels().inc()": (prom_inc_labels, loop),
        "prom Counter child .inc()": (prom_inc_child, empty1),
        "prom Histogram.labels().observe()": (prom_observe_labels, loop),
        "prom Histogram child .observe()": (prom_observe_child, empty1),
        "prom: decision's 4 counters, .labels()": (prom_decision, loop),
        "prom: four step observes, .labels()": (prom_steps, loop),
    }
    bodies = {f for pair in variants.values() for f in pair}
    best = {f: float("inf") for f in bodies}
    for _ in range(rounds):
        for f in bodies:
            best[f] = min(best[f], per_call_ns(f, calls))
    out = {name: max(0.0, best[f] - best[base]) for name, (f, base) in variants.items()}
    # Off the request path: one exposition of an 8-pod fleet's families.
    for i in range(8):
        plain.decision("prod", "miss", "", i, 100, 0, 0.0, 1000)

    def scrape_once(n: int) -> None:
        for _ in range(n):
            generate_latest(plain.registry)

    scrape = min(per_call_ns(scrape_once, 20) for _ in range(10))
    out["scrape: generate_latest (8 pods), per scrape"] = scrape
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="ns per metrics recording call.")
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=25)
    args = ap.parse_args(argv)
    figures = measure(args.calls, args.rounds)
    print(
        f"python {platform.python_version()} on {platform.machine()}, "
        f"best of {args.rounds} rounds of {args.calls} calls"
    )
    width = max(len(k) for k in figures)
    for name, ns in figures.items():
        unit = f"{ns / 1000:10.1f} us" if name.startswith("scrape") else f"{ns:10.0f} ns"
        print(f"{name:<{width}}  {unit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
