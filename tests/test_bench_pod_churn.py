"""``bench.pod_churn`` runs and shows what it claims to: with reuse the slots and the
metrics stay put as pods come and go; kept forever, they grow with every pod."""

import json
from pathlib import Path

from ace_extproc.routing.fleet import FREE_SLOTS_KEPT
from bench import pod_churn


def test_pod_churn_bench_compares_reuse_with_slots_kept_forever(tmp_path: Path) -> None:
    out = tmp_path / "churn.json"
    departed = FREE_SLOTS_KEPT + 40
    args = ["--departed", f"0,{departed}", "--iterations", "25", "--out", str(out)]
    assert pod_churn.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["command"] == "python -m bench.pod_churn " + " ".join(args)
    rows = {(r["departed"], r["variant"]): r for r in doc["rows"]}
    assert rows[0, "reuse"]["slots"] == rows[0, "no_reuse"]["slots"] == 8
    assert rows[departed, "reuse"]["slots"] == 8 + FREE_SLOTS_KEPT + 1
    assert rows[departed, "no_reuse"]["slots"] == 8 + departed
    grown = rows[departed, "no_reuse"]["metrics_series"] - rows[departed, "reuse"]["metrics_series"]
    assert grown > 0 and all(r["decision_p50_us"] > 0 for r in rows.values())
