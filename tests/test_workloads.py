"""bench.workloads: the suite's shapes, trace replay and validation, stress shapes."""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ace_extproc.request import parse
from ace_extproc.sim.protocol import filler_text
from ace_extproc.sim.tokenizer import render_chat
from bench import workloads
from bench.workloads import azure, mooncake, shape, stress, suite
from bench.workloads.base import Request, TraceError, Workload, scaled_out
from bench.workloads.text import MOONCAKE_BLOCK_BYTES, block_text, blocks_prompt

TRACES = workloads.traces_dir()
MOONCAKE = TRACES / workloads.TRACE_FILES["mooncake"]
AZURE_CODE = TRACES / workloads.TRACE_FILES["azure-code"]
AZURE_CONV = TRACES / workloads.TRACE_FILES["azure-conv"]
needs_traces = pytest.mark.skipif(not MOONCAKE.exists(), reason="shared traces not present")


@pytest.fixture(scope="module")
def seed800() -> Workload:
    return workloads.get("seed800")


def body(r: Request) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(r.body)
    return out


def sessions(w: Workload) -> dict[str, list[Request]]:
    by: dict[str, list[Request]] = defaultdict(list)
    for r in w.requests:
        by[r.session].append(r)
    return by


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n  # binary search on slice equality: C-speed compares
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# -- the suite -----------------------------------------------------------------------------


def test_suite_is_deterministic() -> None:
    a, b = workloads.get("seed800", seed=3), workloads.get("seed800", seed=3)
    assert [(r.arrival_s, r.body, r.headers) for r in a.requests] == [
        (r.arrival_s, r.body, r.headers) for r in b.requests
    ]
    other = workloads.get("seed800", seed=4)
    assert [r.body for r in other.requests] != [r.body for r in a.requests]


def test_suite_size_and_families(seed800: Workload) -> None:
    assert len(seed800.requests) == 800
    assert Counter(r.family for r in seed800.requests) == dict.fromkeys(suite.FAMILIES, 200)
    arrivals = [r.arrival_s for r in seed800.requests]
    assert arrivals == sorted(arrivals)
    for r in seed800.requests:
        b = body(r)
        assert b["model"] == "sim-llama" and b["max_tokens"] == r.output_tokens >= 1
        parse(r.path, r.body)  # the router understands every body


def test_family_shapes(seed800: Workload) -> None:
    by_family: dict[str, list[int]] = defaultdict(list)
    for rs in sessions(seed800).values():
        by_family[rs[0].family].append(len(rs))
        arrivals = [r.arrival_s for r in rs]
        if rs[0].family != "fewshot":
            assert all(b > a for a, b in itertools.pairwise(arrivals))
    assert min(by_family["chat"]) >= 2 and max(by_family["chat"]) <= 6
    assert all(4 <= n <= 12 for n in by_family["docqa"])
    assert all(12 <= n <= 28 for n in by_family["agent"])
    assert set(by_family["fewshot"]) == {1}  # independent questions: nothing waits
    for r in seed800.requests:
        b = body(r)
        if r.family == "fewshot":  # 5 exemplar pairs, then the question
            roles = [m["role"] for m in b["messages"]]
            assert roles == ["system"] + ["user", "assistant"] * 5 + ["user"]
        if r.family == "agent":
            assert {t["function"]["name"] for t in b["tools"]} >= {"bash", "submit"}


def test_sessions_extend_the_previous_request(seed800: Workload) -> None:
    checked = Counter[str]()
    for rs in sessions(seed800).values():
        family = rs[0].family
        if family not in ("chat", "agent"):
            continue
        for prev, nxt in itertools.pairwise(rs):
            a, b = body(prev), body(nxt)
            n = len(a["messages"])
            assert b["messages"][:n] == a["messages"]
            reply = b["messages"][n]
            assert reply["role"] == "assistant"
            if family == "chat":  # the simulated engine's own reply, then the next question
                assert reply["content"] == filler_text(prev.output_tokens)
                assert [m["role"] for m in b["messages"][n:]] == ["assistant", "user"]
            else:  # a tool call of about max_tokens tokens, then its result
                rendered = render_chat([reply], add_generation_prompt=False)
                assert abs(len(rendered) / 4 - prev.output_tokens) < 20
                assert [m["role"] for m in b["messages"][n:]] == ["assistant", "tool"]
            # The engine's prompt of the next turn starts with this turn's whole prompt.
            assert render_chat(b["messages"], b.get("tools")).startswith(
                render_chat(a["messages"], a.get("tools"))
            )
            checked[family] += 1
    assert checked["chat"] > 100 and checked["agent"] > 150


def test_docqa_shares_the_document_prefix(seed800: Workload) -> None:
    for rs in list(sessions(seed800).values()):
        if rs[0].family != "docqa":
            continue
        content = body(rs[0])["messages"][1]["content"]
        document = content[: content.index("\n\nQuestion:")]
        first = parse(rs[0].path, rs[0].body).prompt
        doc_end = first.index(document.encode()) + len(document)
        assert len(document) > 10_000  # >= ~3K tokens
        for r in rs[1:]:
            assert common_prefix(first, parse(r.path, r.body).prompt) >= doc_end


def test_context_buckets_all_populated() -> None:
    for seed in (0, 1):
        w = workloads.get("seed800", seed=seed)
        tokens = [shape.prompt_tokens(r) for r in w.requests]
        counts = Counter(shape.bucket(t) for t in tokens)
        assert all(counts[b] >= 15 for b in shape.BUCKETS), counts
        assert min(tokens) < 1024 and 24_576 < max(tokens) <= 32_000
        # Also populated if the buckets are read as upper bounds (<=1K, <=4K, ...).
        assert all(
            any(lo < t <= hi for t in tokens)
            for lo, hi in ((0, 1024), (1024, 4096), (4096, 16384), (16384, 32768))
        )


# -- Mooncake ------------------------------------------------------------------------------


@needs_traces
def test_mooncake_best_case_reuse_of_the_shipped_trace() -> None:
    records = mooncake.read(MOONCAKE)
    assert len(records) == 3993
    assert mooncake.best_case_reuse(MOONCAKE) == pytest.approx(0.651, abs=0.0005)
    as_dicts = [{"input_length": r.input_length, "hash_ids": r.hash_ids} for r in records]
    assert mooncake.best_case_reuse(as_dicts) == mooncake.best_case_reuse(records)


def test_best_case_reuse_counts_tokens_of_repeated_prefixes() -> None:
    records = [
        {"input_length": 1024, "hash_ids": [1, 2]},
        {"input_length": 700, "hash_ids": [1, 2]},  # 512 + 188 reused
        {"input_length": 1024, "hash_ids": [3, 2]},  # block 2 after another prefix: new
    ]
    assert mooncake.best_case_reuse(records) == pytest.approx(700 / 2748)


def test_block_texts_are_fixed_and_distinct() -> None:
    assert block_text(7) == block_text(7)
    assert len(block_text(7)) == len(block_text(123456789)) == MOONCAKE_BLOCK_BYTES
    assert block_text(7).isascii() and block_text(7) != block_text(8)
    assert len(blocks_prompt([1, 2, 3], 1100)) == 4400


@needs_traces
def test_mooncake_text_has_the_trace_prefix_structure(tmp_path: Path) -> None:
    # The trace's sharing builds up over time: replay its last 800 lines.
    tail = tmp_path / "tail.jsonl"
    tail.write_text("".join(MOONCAKE.read_text().splitlines(keepends=True)[-800:]))
    records = mooncake.read(tail)
    w = workloads.get(f"trace:{tail}")
    assert len(w.requests) == len(records) == 800
    prompts = []
    for rec, r in zip(records, w.requests, strict=True):
        b = body(r)
        assert r.path == "/v1/completions" and b["max_tokens"] == rec.output_length
        assert len(b["prompt"]) == rec.input_length * 4  # exactly input_length sim tokens
        prompts.append(b["prompt"])
    # Pairs that share a first block (where the structure is), plus neighbours.
    groups: dict[int, list[int]] = defaultdict(list)
    for i, rec in enumerate(records):
        groups[rec.hash_ids[0]].append(i)
    pairs = [(g[j], g[j + 1]) for g in groups.values() for j in range(len(g) - 1)]
    pairs += [(i, i + 1) for i in range(0, len(records) - 1, 7)]
    shared = 0
    for i, j in pairs:
        ids_i, ids_j = records[i].hash_ids, records[j].hash_ids
        k = common_prefix(ids_i, ids_j)
        n = common_prefix(prompts[i], prompts[j])
        if k < len(ids_i) and k < len(ids_j):
            # The whole k blocks, then at most the next ids' common leading digits:
            # less than one engine cache block (64 bytes).
            assert k * MOONCAKE_BLOCK_BYTES <= n < k * MOONCAKE_BLOCK_BYTES + 16
        else:  # one is a prefix of the other: all of the shorter prompt
            assert n == min(len(prompts[i]), len(prompts[j]))
        shared += k > 0
    assert shared > 200


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _line(**fields: Any) -> str:
    rec = {"timestamp": 20, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}
    rec.update(fields)
    return json.dumps({k: v for k, v in rec.items() if v is not None}) + "\n"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (_line(hash_ids=None), "missing field 'hash_ids'"),
        (_line(timestamp=None), "missing field 'timestamp'"),
        (_line(input_length="600"), "'input_length' must be an integer"),
        (_line(output_length=1.5), "'output_length' must be an integer"),
        (_line(timestamp="soon"), "'timestamp' must be a non-negative number"),
        (_line(hash_ids=[1, "2"]), "'hash_ids' must be a list of integers"),
        (_line(input_length=-600), "'input_length' must be positive"),
        (_line(output_length=-1), "'output_length' must be positive"),
        (_line(hash_ids=[1, 2, 3]), "'hash_ids' has 3 blocks but input_length 600 needs"),
        (_line(input_length=1025), "'hash_ids' has 2 blocks but input_length 1025 needs"),
        (_line(timestamp=5), "timestamp 5 is before the previous request's 10"),
        ('{"timestamp": 20, "input_length": \n', "malformed JSON"),
        ("[1, 2]\n", "expected a JSON object"),
    ],
)
def test_mooncake_bad_input_names_file_and_line(tmp_path: Path, bad: str, message: str) -> None:
    good = _line(timestamp=0) + "\n" + _line(timestamp=10)  # line 2 is blank
    path = _write(tmp_path, "t.jsonl", good + bad + _line(timestamp=30))
    with pytest.raises(TraceError) as exc:
        mooncake.read(path)
    assert f"{path}:4: " in str(exc.value) and message in str(exc.value)


def test_mooncake_empty_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "empty.jsonl", "\n")
    with pytest.raises(TraceError, match=f"{path}:1: the trace is empty"):
        workloads.get(f"trace:{path}")


def test_any_mooncake_file_drops_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (
        _line(timestamp=0)
        + _line(timestamp=1000, input_length=1024, hash_ids=[1, 9])
        + _line(timestamp=3000, extra="ignored")
    )
    path = _write(tmp_path, "mine.jsonl", text)
    w = workloads.get(f"trace:{path}")
    assert w.name == f"trace:{path}" and [r.arrival_s for r in w.requests] == [0, 1, 3]
    assert [r.arrival_s for r in workloads.get(f"trace:{path}", speed=2).requests] == [0, 0.5, 1.5]
    rated = workloads.get(f"trace:{path}", rate=2.0).requests  # 2 gaps in 1 s
    assert rated[-1].arrival_s == pytest.approx(1.0)
    assert len(workloads.get(f"trace:{path}", limit=2).requests) == 2
    # The default trace directory can be moved with ACE_TRACES_DIR.
    _write(tmp_path, workloads.TRACE_FILES["mooncake"], text)
    monkeypatch.setenv("ACE_TRACES_DIR", str(tmp_path))
    assert len(workloads.get("mooncake").requests) == 3


# -- Azure ---------------------------------------------------------------------------------


@needs_traces
def test_azure_code_lengths_and_arrivals() -> None:
    w = workloads.get("azure-code", limit=400)
    records = azure.read(AZURE_CODE, limit=400)
    assert len(w.requests) == 400
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    for rec, r in zip(records, w.requests, strict=True):
        assert shape.prompt_tokens(r) == rec.context_tokens
        assert r.output_tokens == rec.generated_tokens
    # Requests on one repository share its context.
    assert shape.best_case_reuse([shape.engine_prompt(r) for r in w.requests]) > 0.2
    assert len(workloads.get("azure-code").requests) == azure.DEFAULT_LIMIT


@needs_traces
def test_azure_conv_sessions_and_lengths() -> None:
    w = workloads.get("azure-conv", limit=600, seed=1)
    assert w.requests == workloads.get("azure-conv", limit=600, seed=1).requests
    records = azure.read(AZURE_CONV, limit=600)
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals)
    for rec, r in zip(records, w.requests, strict=True):
        tokens = shape.prompt_tokens(r)
        # Exact, but for the template's floor (~33 tokens with an empty history).
        assert tokens == rec.context_tokens or (rec.context_tokens < tokens <= 40)
    convs = [rs for rs in sessions(w).values() if len(rs) > 1]
    assert len(convs) > 30
    for rs in convs:
        for prev, nxt in itertools.pairwise(rs):
            a, b = body(prev), body(nxt)
            assert b["messages"][: len(a["messages"])] == a["messages"]
            assert nxt.arrival_s >= prev.arrival_s + prev.output_tokens * 0.02


@needs_traces
def test_azure_speed_scales_arrivals() -> None:
    slow = workloads.get("azure-code", limit=50)
    fast = workloads.get("azure-code", limit=50, speed=4)
    assert fast.requests[-1].arrival_s == pytest.approx(slow.requests[-1].arrival_s / 4, abs=1e-5)


HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = "2023-11-16 18:17:03.9799600,4808,10\n"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("2023-11-16 18:17:04.1,12\n", "expected 3 fields, got 2"),
        ("yesterday,12,5\n", "TIMESTAMP 'yesterday' is not a date and time"),
        ("2023-11-16 18:17:04.1,-12,5\n", "ContextTokens must be positive, got -12"),
        ("2023-11-16 18:17:04.1,12,many\n", "GeneratedTokens must be an integer"),
        ("2023-11-16 18:17:01.0,12,5\n", "is before the previous row's"),
    ],
)
def test_azure_bad_input_names_file_and_line(tmp_path: Path, bad: str, message: str) -> None:
    path = _write(tmp_path, "a.csv", HEADER + ROW + ROW + bad + ROW)
    with pytest.raises(TraceError) as exc:
        azure.read(path)
    assert f"{path}:4: " in str(exc.value) and message in str(exc.value)


def test_azure_bad_header_and_empty(tmp_path: Path) -> None:
    for text, message in (
        ("", ":1: the trace is empty"),
        ("time,ctx,gen\n" + ROW, ":1: expected the header"),
        (HEADER, ":2: the trace has a header but no requests"),
    ):
        path = _write(tmp_path, "b.csv", text)
        with pytest.raises(TraceError, match=message):
            workloads.get("azure-conv", path=str(path))


# -- stress shapes and the registry --------------------------------------------------------


def test_hot_prefix_share() -> None:
    w = workloads.get("hot-prefix")
    assert len(w.requests) == stress.HOT_REQUESTS
    prompts = [parse(r.path, r.body).prompt for r in w.requests]
    hot = body(next(r for r in w.requests if r.family == "hot"))["messages"][0]["content"]
    share = sum(hot.encode() in p[:20_000] for p in prompts) / len(prompts)
    assert share == pytest.approx(0.9, abs=0.005)
    rest = [p for p in prompts if hot.encode() not in p]
    assert len({p[:600] for p in rest}) == len(rest)  # the rest are unique from the start


def test_churn_events() -> None:
    w = workloads.get("churn")
    assert w.initially_absent == (stress.CHURN_JOINS,)
    assert [(e.action, e.slot) for e in w.events] == [
        ("remove", stress.CHURN_LEAVES),
        ("add", stress.CHURN_JOINS),
    ]
    end = w.requests[-1].arrival_s
    assert 0 < w.events[0].at_s < w.events[1].at_s < end
    assert len(w.requests) == 4 * stress.CHURN_PER_FAMILY


def test_burst32k_shape() -> None:
    w = workloads.get("burst32k")
    by = sessions(w)
    assert len(by) == stress.BURSTS * stress.BURST_SESSIONS
    assert all(len(rs) == 1 + stress.BURST_FOLLOW_UPS for rs in by.values())
    for burst in range(stress.BURSTS):
        starts = [rs[0].arrival_s for s, rs in by.items() if s.startswith(f"burst{burst}-")]
        assert len(starts) == stress.BURST_SESSIONS and max(starts) - min(starts) < 1.0
    tokens = [shape.prompt_tokens(r) for r in w.requests]
    assert all(shape.bucket(t) == "32K" and t <= 32_000 for t in tokens)


def test_registry() -> None:
    assert workloads.NAMES == (
        "seed800", "mooncake", "azure-code", "azure-conv", "hot-prefix", "churn", "burst32k",
        "conv-burst", "lora-mix",
    )  # fmt: skip
    assert len(workloads.get("burst32k", limit=10).requests) == 10
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.get("nope")
    with pytest.raises(ValueError, match="path and speed"):
        workloads.get("seed800", path="x")
    default = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"
    if "ACE_TRACES_DIR" not in os.environ:
        assert workloads.traces_dir() == default


def test_conv_burst_has_the_held_back_trace_s_shape() -> None:
    """One shared first block, heavy-tailed lengths, whole-second bursts at ~3.4 req/s,
    and later turns that extend earlier ones."""
    w = workloads.get("conv-burst")
    prompts = [msgspec.json.decode(r.body)["prompt"] for r in w.requests]
    first_blocks = {p[:MOONCAKE_BLOCK_BYTES] for p in prompts}
    assert len(first_blocks) == 1  # every prompt starts with the same 512-token block
    tokens = sorted(len(p) // 4 for p in prompts)
    median, mean = tokens[len(tokens) // 2], sum(tokens) / len(tokens)
    assert mean > 1.3 * median and tokens[-1] > 8 * median  # a heavy tail
    arrivals = [r.arrival_s for r in w.requests]
    assert all(a == int(a) for a in arrivals)  # whole seconds
    assert max(Counter(arrivals).values()) >= 8  # bursts
    assert 3.0 < len(arrivals) / (arrivals[-1] - arrivals[0]) < 3.8
    # A later turn begins with its conversation's own first block, after the shared one:
    # about two requests in three (three turns a conversation on average).
    seen: set[str] = set()
    later = 0
    for p in prompts:
        head = p[: 2 * MOONCAKE_BLOCK_BYTES]
        later += head in seen
        seen.add(head)
    assert len(prompts) // 3 < later < len(prompts) * 5 // 6
    assert workloads.get("conv-burst", seed=1).requests != w.requests


def test_lora_mix_names_adapters_by_popularity_each_with_its_own_prefix() -> None:
    w = workloads.get("lora-mix", limit=600)
    assert w.max_loras == 4 and len(w.requests) == 600
    bodies = [msgspec.json.decode(r.body) for r in w.requests]
    counts = Counter(b["model"] for b in bodies)
    assert all(name.startswith("adapter-") for name in counts)
    ranked = [n for _, n in sorted(((c, n) for n, c in counts.items()), reverse=True)]
    # Zipf: a few hot adapters and a long tail.
    assert counts[ranked[0]] > 5 * counts[ranked[len(ranked) // 2]] and len(counts) > 30
    # An adapter's sessions share its system prompt; two adapters share none.
    system = {}
    for b in bodies:
        system.setdefault(b["model"], set()).add(b["messages"][0]["content"])
    assert all(len(s) == 1 for s in system.values())
    assert len({next(iter(s)) for s in system.values()}) == len(system)


def test_a_scaled_out_workload_has_its_last_pods_join_a_third_of_the_way() -> None:
    base = workloads.get("lora-mix", limit=300)
    out = scaled_out(base, 8, 2)
    third = round(base.requests[-1].arrival_s / 3, 3)
    assert out.initially_absent == (6, 7) and out.requests is base.requests
    assert [(e.at_s, e.action, e.slot) for e in out.events] == [
        (third, "add", 6),
        (third, "add", 7),
    ]
    assert out.max_loras == base.max_loras
    for bad in (0, 8):
        with pytest.raises(ValueError, match="late pods"):
            scaled_out(base, 8, bad)
    with pytest.raises(ValueError, match="already adds or removes"):
        scaled_out(workloads.get("churn"), 8, 1)
