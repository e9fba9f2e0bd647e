"""``seed800``: the product's 800-prompt suite, four families of 200 requests.

Shaped like the public benchmarks each family names. All text is seeded pseudo-text
(:mod:`.text`); tokens are the simulated engine's (4 bytes of rendered prompt each).
Measured at seed 0 (other seeds draw other sizes from the same plans):

======= ============ ============== ================ ============ ===================
family  like         sessions       requests each    prompt tok   shared prefix
                                                     min/p50/max
======= ============ ============== ================ ============ ===================
chat    MT-Bench     58 chats       2-6 turns        376 / 2.2K   1 of 8 system prompts
                                    (mean 3.4)       / 5.0K       (300-2,400 tok, one per
                                                                  MT-Bench category), then
                                                                  the chat's history
docqa   LongBench,   24 documents   4-12 questions   3.6K / 5.3K  1 of 3 task prompts
        L-Eval                      (mean 8.3)       / 26K        (120-220 tok), then the
                                                                  document: 55% 3-5K tok,
                                                                  25% 6-10K, 12% 12-20K,
                                                                  8% 24-30K
agent   SWE-bench    10 runs        12-28 steps      3.8K / 13K   1,200-tok system prompt
                                    (mean 20)        / 31K        + 4 tools (all runs);
                                                                  1 of 6 repo trees
                                                                  (1.5-4K tok); the run's
                                                                  growing history
fewshot MMLU 5-shot  19 subjects    7-13 questions,  858 / 1.1K   the subject's line + 5
                                    each its own     / 3.9K       exemplar Q/A turns
                                    session
======= ============ ============== ================ ============ ===================

Per turn: chat user turns 10-300 tokens (30% of first turns paste a 400-1,500-token
passage), replies 64-768 (log-uniform); document questions 12-60 tokens, answers
16-96 (summaries 128-512), independent questions on one document, each a request
(system, then the document and the question in one user turn, LongBench's template);
agent runs aim at a final context spread over 14K-31.5K tokens, each step a thought
and one tool call (view_file, bash, edit_file; submit last), each result sized to
reach that target (kept under 32,000 tokens); 5-shot exemplars and question 50-150
tokens for 70% of subjects, 200-350 for 20%, 450-650 for 10%, ``max_tokens`` 1.
Context buckets (1K/4K/16K/32K, see :func:`.shape.bucket`): 234 / 336 / 199 / 31.

Replies: a later turn carries the earlier turns and the assistant's replies. A chat
reply is the simulated engine's own output for that ``max_tokens`` (``filler_text``,
4 bytes a token), so the next prompt is exactly the previous prompt, the reply the
engine gave, and the new user turn. An agent reply is a tool call whose rendered
text is ``max_tokens`` tokens long (the engine generates filler of that length; the
next prompt carries the call, as an agent scaffold would).

Arrivals (:mod:`.sessions`): session starts are a Poisson process with all families
interleaved, at ``rate * sessions / requests`` so that ``rate`` requests/s are
offered; a session's next turn comes after the previous reply would be done
(1 s + ``max_tokens`` x 20 ms) plus think time: chat 2 s + Exp(6 s), documents
1 s + Exp(4 s), agent tool runs 0.3 s + Exp(1.5 s). Few-shot questions are
independent one-request arrivals. Chats, documents and runs send ``x-session-id``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from .base import Workload
from .sessions import Session, Turn, chat_body, logu, rendered_tokens, reply, schedule, split
from .text import BYTES_PER_TOKEN, tagged, tokens_text, words

NAME = "seed800"
FAMILY_SIZE = 200
FAMILIES = ("chat", "docqa", "agent", "fewshot")
# Requests/s offered. At 10, an 8-pod fleet would spend ~26% of its time prefilling if
# nothing were cached (busy part of the run, default TTFT model), ~3% at best-case
# reuse: cache-blind routing queues behind long prefills, nothing saturates. Sessions
# pace themselves, so higher rates add little load (~30% at 16).
DEFAULT_RATE = 10.0
AGENT_CONTEXT_CAP = 32_000  # prompt + reply stay inside a 32K-token model


def build(seed: int = 0, rate: float | None = None, per_family: int = FAMILY_SIZE) -> Workload:
    sessions: list[Session] = []
    for family, make in _MAKERS.items():
        sessions += make(random.Random(f"{NAME}:{family}:{seed}"), per_family)
    rate = DEFAULT_RATE if rate is None else rate
    requests = schedule(sessions, rate, random.Random(f"{NAME}:arrivals:{seed}"))
    return Workload(
        name=NAME,
        description=(
            f"{len(requests)} requests: multi-turn chat, shared-document QA, coding-agent "
            f"loops and 5-shot prompts ({per_family} each), Poisson at {rate:g} req/s"
        ),
        requests=requests,
    )


# -- chat: MT-Bench-like -------------------------------------------------------------------

CHAT_CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
)  # fmt: skip
CHAT_SYSTEM_TOKENS = (300, 500, 700, 900, 1100, 1400, 1800, 2400)


def chat(rng: random.Random, n_requests: int) -> list[Session]:
    systems = [
        tagged(f"You are the {cat} assistant of the ACME help desk. ", rng, tokens * 4)
        for cat, tokens in zip(CHAT_CATEGORIES, CHAT_SYSTEM_TOKENS, strict=True)
    ]

    def draw() -> int:
        return rng.choices((2, 3, 4, 5, 6), weights=(35, 25, 20, 12, 8))[0]

    sessions = []
    for k, n_turns in enumerate(split(rng, n_requests, 2, 6, draw)):
        session = Session(f"chat-{k:03d}", "chat")
        messages: list[dict[str, Any]] = [{"role": "system", "content": rng.choice(systems)}]
        for turn in range(n_turns):
            if turn == 0 and rng.random() < 0.3:  # a pasted passage to work on
                user = tokens_text(rng, logu(rng, 400, 1500))
            else:
                user = tokens_text(rng, logu(rng, 20, 300) if turn == 0 else logu(rng, 10, 200))
            messages.append({"role": "user", "content": user})
            max_tokens = logu(rng, 64, 768)
            think = 2.0 + rng.expovariate(1 / 6.0)  # read the answer, type the next one
            session.turns.append(Turn(chat_body(messages, max_tokens), max_tokens, think))
            messages.append(reply(max_tokens))
        sessions.append(session)
    return sessions


# -- docqa: LongBench / L-Eval-like --------------------------------------------------------

# (task, system prompt tokens, opening of the user message, max_tokens range)
DOC_TASKS = (
    ("single-document QA", 150, "Read the document and answer the question.", (16, 96)),
    ("multi-document QA", 220, "The following are given passages.", (16, 96)),
    ("summarization", 120, "Read the report and answer the request.", (128, 512)),
)
DOC_TASK_WEIGHTS = (50, 30, 20)


def doc_tokens(q: float, rng: random.Random) -> int:
    """Document size at quantile ``q``: mostly ~4K tokens, with a long tail
    (LongBench's longer tasks, L-Eval's long documents)."""
    if q < 0.55:
        return rng.randint(3_000, 5_000)
    if q < 0.8:
        return rng.randint(6_000, 10_000)
    if q < 0.92:
        return rng.randint(12_000, 20_000)
    return rng.randint(24_000, 30_000)


def docqa(rng: random.Random, n_requests: int) -> list[Session]:
    systems = [
        tagged(f"You are a careful analyst doing {task}. ", rng, tokens * 4)
        for task, tokens, _, _ in DOC_TASKS
    ]
    counts = split(rng, n_requests, 4, 12, lambda: rng.randint(5, 11))
    quantiles = [(i + 0.5) / len(counts) for i in range(len(counts))]
    rng.shuffle(quantiles)
    sessions = []
    for k, (n_questions, q) in enumerate(zip(counts, quantiles, strict=True)):
        task = rng.choices(range(len(DOC_TASKS)), weights=DOC_TASK_WEIGHTS)[0]
        _, _, opening, (lo, hi) = DOC_TASKS[task]
        document = tagged(f"Document {k}.\n", rng, doc_tokens(q, rng) * BYTES_PER_TOKEN)
        session = Session(f"doc-{k:03d}", "docqa")
        for i in range(n_questions):
            # Independent questions on one document: the prefix is the document, and
            # each question is its own request (LongBench's prompt template shape).
            question = tokens_text(rng, logu(rng, 12, 60))
            messages = [
                {"role": "system", "content": systems[task]},
                {
                    "role": "user",
                    "content": f"{opening}\n\n{document}\n\nQuestion: {question}\nAnswer:",
                },
            ]
            max_tokens = logu(rng, lo, hi)
            think = 1.0 + rng.expovariate(1 / 4.0) if i else 0.0
            session.turns.append(Turn(chat_body(messages, max_tokens), max_tokens, think))
        sessions.append(session)
    return sessions


# -- agent: SWE-bench-like -----------------------------------------------------------------


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": d} for p, d in params.items()},
                "required": list(params),
            },
        },
    }


AGENT_TOOLS = [
    _tool("bash", "Run a shell command in the repository.", command="the command line"),
    _tool("view_file", "Show a file with line numbers.", path="path from the repo root"),
    _tool(
        "edit_file",
        "Replace one exact occurrence of old_str with new_str in a file.",
        path="path from the repo root",
        old_str="text to replace",
        new_str="replacement text",
    ),
    _tool("submit", "Submit the current diff as the fix.", summary="what was changed and why"),
]
AGENT_REPOS = ("astropy", "django", "flask", "requests", "sklearn", "sympy")
AGENT_SYSTEM_TOKENS = 1_200


def _path(rng: random.Random) -> str:
    parts = words(rng, 40).split()[:3] or ["main"]
    return "/".join(p.strip(".") or "x" for p in parts) + ".py"


def _tree(repo: str, rng: random.Random, tokens: int) -> str:
    # Sentences become path lines: "a b c." -> "a/b/c.py"
    body = words(rng, tokens * 4).replace(" ", "/").replace("./", ".py\n")
    return f"Repository {repo}, file tree:\n{body}"[: tokens * 4]


def agent(rng: random.Random, n_requests: int) -> list[Session]:
    system = tagged(
        "You are a software engineering agent. Fix the issue in the repository with the "
        "tools; think step by step and call one tool per turn. ",
        rng,
        AGENT_SYSTEM_TOKENS * 4,
    )
    trees = {repo: _tree(repo, rng, logu(rng, 1_500, 4_000)) for repo in AGENT_REPOS}
    steps = split(rng, n_requests, 12, 28, lambda: rng.randint(14, 26))
    # Final contexts spread evenly over 14K-31.5K, so every run's later steps are long.
    targets = [14_000 + 17_500 * (i + rng.random()) / len(steps) for i in range(len(steps))]
    rng.shuffle(targets)
    sessions = []
    for k, (n_steps, target) in enumerate(zip(steps, targets, strict=True)):
        repo = rng.choice(AGENT_REPOS)
        issue = tagged(f"Issue #{1000 + k}: ", rng, logu(rng, 200, 800) * 4)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"{trees[repo]}\n\n{issue}"},
        ]
        session = Session(f"agent-{k:03d}", "agent")
        context = rendered_tokens(messages, AGENT_TOOLS)
        for step in range(n_steps):
            call_id = f"call_{k}_{step}"
            name, args = _action(rng, step == n_steps - 1)
            thought = tokens_text(rng, logu(rng, 20, 80))
            arguments = json.dumps(args)
            rendered = f'{thought}\n{{"name": "{name}", "parameters": {arguments}}}'
            max_tokens = -(-len(rendered) // BYTES_PER_TOKEN)
            think = 0.3 + rng.expovariate(1 / 1.5) if step else 0.0  # run the tool
            body = chat_body(messages, max_tokens, AGENT_TOOLS)
            session.turns.append(Turn(body, max_tokens, think))
            messages.append(
                {
                    "role": "assistant",
                    "content": thought,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": arguments},
                        }
                    ],
                }
            )
            if step == n_steps - 1:
                break
            # Observation sized to reach the run's target by its last step.
            left = n_steps - 1 - step
            grow = (target - context) / left - max_tokens - 20
            obs_tokens = max(20, round(grow * rng.uniform(0.3, 1.7)))
            obs_tokens = min(obs_tokens, max(20, AGENT_CONTEXT_CAP - 400 - context))
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _observation(name, args, rng, obs_tokens),
                }
            )
            context = rendered_tokens(messages, AGENT_TOOLS)
        sessions.append(session)
    return sessions


def _action(rng: random.Random, last: bool) -> tuple[str, dict[str, str]]:
    if last:
        return "submit", {"summary": tokens_text(rng, 30)}
    name = rng.choices(("view_file", "bash", "edit_file"), weights=(40, 35, 25))[0]
    if name == "view_file":
        return name, {"path": _path(rng)}
    if name == "bash":
        return name, {"command": f"grep -rn {words(rng, 12).split()[0]} . | head -50"}
    return name, {"path": _path(rng), "old_str": words(rng, 60), "new_str": words(rng, 80)}


def _observation(name: str, args: dict[str, str], rng: random.Random, tokens: int) -> str:
    head = {
        "view_file": f"[File: {args.get('path')}]\n",
        "bash": f"$ {args.get('command')}\n",
        "edit_file": f"The file {args.get('path')} has been edited. Context:\n",
    }[name]
    return tagged(head, rng, tokens * BYTES_PER_TOKEN)


# -- fewshot: MMLU 5-shot-like -------------------------------------------------------------

FEWSHOT_SUBJECTS = (
    "abstract algebra", "anatomy", "astronomy", "college biology", "college chemistry",
    "computer security", "econometrics", "electrical engineering", "formal logic",
    "global facts", "high school european history", "high school geography",
    "high school us history", "international law", "jurisprudence", "machine learning",
    "management", "marketing", "philosophy", "world religions",
)  # fmt: skip
SHOTS = 5


def _question_tokens(q: float, rng: random.Random) -> tuple[int, int]:
    """Per-question token range at quantile ``q``: most subjects short, history-style
    subjects with reading passages long."""
    if q < 0.7:
        return 50, 150
    if q < 0.9:
        return 200, 350
    return 450, 650


def _mc_question(rng: random.Random, lo: int, hi: int) -> str:
    stem = tokens_text(rng, logu(rng, lo, hi))
    choices = "\n".join(f"{c}. {tokens_text(rng, rng.randint(3, 15))}" for c in "ABCD")
    return f"{stem}\n{choices}\nAnswer:"


def fewshot(rng: random.Random, n_requests: int) -> list[Session]:
    subjects = list(FEWSHOT_SUBJECTS)
    counts = split(rng, n_requests, 6, 14, lambda: rng.randint(7, 13))
    while len(subjects) < len(counts):  # more requests than names: number the extras
        subjects.append(
            f"{FEWSHOT_SUBJECTS[len(subjects) % len(FEWSHOT_SUBJECTS)]} {len(subjects)}"
        )
    quantiles = [(i + 0.5) / len(counts) for i in range(len(counts))]
    rng.shuffle(quantiles)
    sessions = []
    for subject, n_questions, q in zip(subjects, counts, quantiles, strict=False):
        lo, hi = _question_tokens(q, rng)
        messages: list[dict[str, Any]] = [
            {
                "role": "system",
                "content": f"The following are multiple choice questions (with answers) "
                f"about {subject}.",
            }
        ]
        for _ in range(SHOTS):
            messages.append({"role": "user", "content": _mc_question(rng, lo, hi)})
            messages.append({"role": "assistant", "content": rng.choice("ABCD")})
        for i in range(n_questions):
            prompt = [*messages, {"role": "user", "content": _mc_question(rng, lo, hi)}]
            # One-request arrivals (an evaluation or a templated product call): each is
            # its own session, so nothing waits for another question's answer.
            slug = subject.replace(" ", "_")
            session = Session(f"fewshot-{slug}-{i:02d}", "fewshot", sticky=False)
            session.turns.append(Turn(chat_body(prompt, 1), 1))
            sessions.append(session)
    return sessions


_MAKERS: dict[str, Callable[[random.Random, int], list[Session]]] = {
    "chat": chat,
    "docqa": docqa,
    "agent": agent,
    "fewshot": fewshot,
}
