"""What sharing placements with other replicas costs one replica's CPU (router.share_url).

    python -m bench.sharing_cost [--rounds 15] [--placements 2000]

Per placement, for prompts of 1K/4K/16K/32K tokens (8/32/128/256 router blocks):
``note`` (all that sharing adds to the request path: a tuple appended to the outbox),
``encode`` (the publisher, in batches of 16, as a burst makes them), ``decode`` and
``apply`` (the subscriber: ``Learner.apply`` records the decoded blocks in this
replica's index as its own pick would, and counts the load). A replica publishes what
it places and applies what each other replica places, so with N replicas sharing, one
routed request costs the fleet ``note + encode`` once and ``decode + apply`` N - 1 times
(the last columns, N = 3 and 10); with the traffic spread evenly that is also each
replica's cost per request it routes. Each figure is the best of ``--rounds`` rounds,
each timing every step in turn over the same placements (so a noisy neighbour hits all
alike). Writes ``bench/results/sharing_cost.json``.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from collections.abc import Callable
from typing import Any

from ace_extproc import native
from ace_extproc.app import App, build
from ace_extproc.config import Config, Settings, sim_fleet
from ace_extproc.routing.replicas import Learner, Placement, ReplicaSync, decode, encode
from bench import record

SIZES = (1024, 4096, 16384, 32768)  # prompt tokens
BATCH = 16  # placements a message
REPLICAS = (3, 10)  # the simulation's three; the chart's autoscaler's default maximum


def processor() -> App:
    return build(Config(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(8)]), Settings()))


def placements(tokens: int, count: int, pods: list[str]) -> list[Placement]:
    """``count`` placements of 64 conversations' prompts, cycled: most records refresh
    blocks the index holds, as the turns of a conversation do."""
    rng = random.Random(tokens)
    blocks = tokens * 4 // Settings().block_bytes
    prompts = [[rng.getrandbits(64) for _ in range(blocks)] for _ in range(64)]
    return [
        Placement(pods[i % len(pods)], prompts[i % 64], "anon", f"s{i % 64}", tokens // 3)
        for i in range(count)
    ]


def measure(tokens: int, count: int, rounds: int) -> dict[str, float]:
    """ns per placement of each step, the best round of each."""
    sender, receiver = processor(), processor()
    pods = [p.key for p in sender.fleet.pods]
    batch = placements(tokens, count, pods)
    sync = ReplicaSync(Learner(sender.fleet, sender.index, None), "redis://unused", 512)
    remember = getattr(receiver.picker, "remember", None)
    learner = Learner(receiver.fleet, receiver.index, remember, receiver.load)
    messages = [encode("r", 512, batch[i : i + BATCH]) for i in range(0, count, BATCH)]
    received = [decode(m)[2] for m in messages]  # as the subscriber applies them

    def note() -> None:
        n = sync.note
        for p in batch:
            n(p.pod, p.blocks, p.tenant, p.session, p.queued_tokens)
        sync._outbox.clear()

    def encoding() -> None:
        for i in range(0, count, BATCH):
            encode("r", 512, batch[i : i + BATCH])

    def decoding() -> None:
        for m in messages:
            decode(m)

    def apply() -> None:
        for placed in received:
            learner.apply(placed)
        for load in receiver.fleet.load:  # as the monitor's drain would, between rounds
            load.inflight, load.queued_prefill_ms = 0, 0.0

    steps: dict[str, Callable[[], None]] = {
        "note": note,
        "encode": encoding,
        "decode": decoding,
        "apply": apply,
    }
    best = {name: float("inf") for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t = time.perf_counter_ns()
            step()
            best[name] = min(best[name], (time.perf_counter_ns() - t) / count)
    for replicas in REPLICAS:
        best[f"per_request_{replicas}_replicas"] = per_request(best, replicas)
    return {k: round(v, 1) for k, v in best.items()}


def per_request(steps: dict[str, float], replicas: int) -> float:
    """CPU a routed request costs the fleet with ``replicas`` sharing: published once,
    learned by each other replica. With the traffic spread evenly it is also what each
    replica spends per request it routes itself, so it grows with the replica count."""
    return steps["note"] + steps["encode"] + (replicas - 1) * (steps["decode"] + steps["apply"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--placements", type=int, default=2000)
    ap.add_argument("--out", default="bench/results/sharing_cost.json")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.placements < BATCH:
        ap.error(f"--rounds must be at least 1 and --placements at least {BATCH}")
    rows: dict[str, Any] = {}
    print(
        f"sharing placements: ns per placement, best of {args.rounds} rounds "
        f"({native.describe()} path)"
    )
    print(f"{'tokens':>7}{'blocks':>7}{'note':>9}{'encode':>9}{'decode':>9}{'apply':>9}"
          + "".join(f"{f'a request, {n} replicas':>24}" for n in REPLICAS))  # fmt: skip
    for tokens in SIZES:
        r = measure(tokens, args.placements, args.rounds)
        rows[str(tokens)] = r
        blocks = tokens * 4 // Settings().block_bytes
        print(
            f"{tokens:>7}{blocks:>7}{r['note']:>9.0f}{r['encode']:>9.0f}{r['decode']:>9.0f}"
            f"{r['apply']:>9.0f}"
            + "".join(f"{r[f'per_request_{n}_replicas']:>24.0f}" for n in REPLICAS)
        )
    doc = {
        "command": record.command("bench.sharing_cost", argv),
        "python": platform.python_version(),
        "path": native.describe(),
        "rounds": args.rounds,
        "placements": args.placements,
        "batch": BATCH,
        "ns_per_placement": rows,
    }
    record.write(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
