"""``bench.monitor_cost`` runs: a monitor watching real simulated pods in another
process, bounded and unbounded, with the lateness of a ticker on its loop."""

import json
from pathlib import Path

from bench import monitor_cost


def test_monitor_cost_bench_watches_the_pods_and_records_the_command(tmp_path: Path) -> None:
    out = tmp_path / "monitor.json"
    args = ["--pods", "3", "--seconds", "0.5", "--budgets", "default,0", "--out", str(out)]
    assert monitor_cost.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["command"] == "python -m bench.monitor_cost " + " ".join(args)
    assert [(r["pods"], r["budget"]) for r in doc["rows"]] == [(3, 200.0), (3, 0.0)]
    for row in doc["rows"]:
        assert 20 <= row["scrapes_per_s"] <= 40  # 3 pods every 100 ms: within the budget
        late = row["late_ms"]
        assert late["p50"] <= late["p99"] <= late["max"] and row["cpu_share"] > 0
