"""Memory of the router's block index per tracked block.

    python -m bench.index_memory [--blocks 1000000] [--pods 8]

Records ``--blocks`` distinct block hashes spread over ``--pods`` pods, 32 blocks a
request as a prompt's blocks arrive, and prints the bytes the index holds per block
twice: as tracemalloc counts them (the bytes Python asked for, objects' headers
included; the C structures allocate through Python's allocator, so they count too)
and as the process's resident memory grew in a separate run (what the allocator
really took, with its size-class rounding). Both of the index's structures, in one
run: the C ``BlockLRU`` the server uses where the extension was built, and the
Python reference (a dict of the hashes' ints). The routing-engine issue's target is
at most 80 bytes per tracked block. Writes bench/results/index_memory.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

from ace_extproc import native
from ace_extproc.routing import BlockIndex

TARGET_BYTES = 80


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(blocks: int, pods: int, pure: bool) -> tuple[BlockIndex, float]:
    """The index after recording ``blocks`` blocks, and seconds spent in ``record``."""
    rng = random.Random(0)
    index = BlockIndex(blocks, pure=pure)  # nothing evicted: every block is held
    for slot in range(pods):
        index.add_pod(slot)
    elapsed = 0.0
    for start in range(0, blocks, 32):
        # Each request's hashes are new int objects that only the index keeps alive,
        # as in the server, so they count.
        prompt = [rng.getrandbits(64) for _ in range(min(32, blocks - start))]
        t = time.perf_counter()
        index.record((start // 32) % pods, prompt)
        elapsed += time.perf_counter() - t
    assert len(index) == blocks
    return index, elapsed


def measure(blocks: int, pods: int, pure: bool) -> dict[str, float]:
    gc.collect()
    rss_before = rss_bytes()
    index, elapsed = build(blocks, pods, pure)
    gc.collect()
    rss = rss_bytes() - rss_before
    del index
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index, _ = build(blocks, pods, pure)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    approx = index.approx_bytes()
    tracemalloc.stop()
    return {
        "blocks": blocks,
        "pods": pods,
        "bytes": held,
        "bytes_per_block": held / blocks,
        "rss_bytes_per_block": rss / blocks,
        "approx_bytes_per_block": approx / blocks,
        "record_ns_per_block": elapsed / blocks * 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Bytes per tracked block in the router's index.")
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--out", default="bench/results/index_memory.json")
    ap.add_argument("--only", choices=["c", "python"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.only:
        print(json.dumps(measure(args.blocks, args.pods, args.only == "python")))
        return 0
    kinds = ["c", "python"] if "lru" in native.used else ["python"]
    # Each in a fresh process: resident growth is read off the process, and memory one
    # structure freed would be reused by the next rather than shown.
    sizes = ["--blocks", str(args.blocks), "--pods", str(args.pods)]
    runs = {
        kind: json.loads(
            subprocess.run(
                [sys.executable, "-m", "bench.index_memory", "--only", kind, *sizes],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        for kind in kinds
    }
    for kind, r in runs.items():
        verdict = "met" if r["bytes_per_block"] <= TARGET_BYTES else "MISSED"
        label = "C BlockLRU" if kind == "c" else "Python dicts"
        print(
            f"{label}: {r['blocks']:,} blocks over {r['pods']} pods: "
            f"{r['bytes'] / 2**20:.1f} MiB, {r['bytes_per_block']:.0f} bytes per block "
            f"(target <= {TARGET_BYTES}: {verdict}); resident growth "
            f"{r['rss_bytes_per_block']:.0f} bytes per block; the index's own estimate "
            f"(approx_bytes) {r['approx_bytes_per_block']:.0f}; record "
            f"{r['record_ns_per_block']:.0f} ns per block"
        )
    if "c" in runs:
        c, py = runs["c"], runs["python"]
        print(
            f"C against Python, same run: {py['bytes_per_block'] / c['bytes_per_block']:.2f}x "
            f"fewer bytes traced, {py['rss_bytes_per_block'] / c['rss_bytes_per_block']:.2f}x "
            f"fewer resident, record {py['record_ns_per_block'] / c['record_ns_per_block']:.2f}x "
            "faster"
        )
    served = runs.get("c", runs["python"])  # what the server uses on this machine
    result = {
        "command": "python -m bench.index_memory",
        "target_bytes_per_block": TARGET_BYTES,
        "structure": "c" if "c" in runs else "python",
    }
    result.update(served)
    result["by_structure"] = runs
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
