"""The named workloads: what each request's prompt is and in which order they go.

Prompts of the synthetic workloads are token ids (drawn below ``vocab`` so any tokenizer
takes them), so their lengths and shared prefixes are exact whatever the model. Each
workload seeds its own generator from its name, so two workloads never share a prefix
by accident. ``multi-turn`` replays chat conversations and needs the server's answers, so
its requests are built lazily: the next turn's history includes the previous answer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


class WorkloadError(ValueError):
    """Bad workload input (a file or an option); the message names what to fix."""


@dataclass
class Request:
    phase: str
    max_tokens: int
    prompt: list[int] | None = None  # /v1/completions
    messages: list[dict] | None = None  # /v1/chat/completions
    answer: str = ""  # set by the client once the request ran


@dataclass
class Shape:
    """Every workload option; each workload reads the ones it documents."""

    docs: int = 4
    questions: int = 3
    doc_tokens: int = 1024
    question_tokens: int = 32
    repeat_count: int = 2
    repeat_mode: str = "tile"
    users: int = 4
    rounds: int = 4
    system_tokens: int = 512
    user_tokens: int = 512
    output_tokens: int = 16
    conversations: str | None = None
    max_turns: int = 0
    vocab: int = 500
    seed: int = 0


@dataclass
class Workload:
    name: str
    total: int
    requests: Callable[[], Iterator[Request]] = field(repr=False)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(n)]


def shared_prefix(s: Shape) -> Workload:
    """``docs`` documents, each asked ``questions`` different questions in a row."""
    rng = random.Random(f"shared-prefix:{s.seed}")
    prompts = []
    for _ in range(s.docs):
        doc = _tokens(rng, s.doc_tokens, s.vocab)
        prompts += [doc + _tokens(rng, s.question_tokens, s.vocab) for _ in range(s.questions)]
    return Workload("shared-prefix", len(prompts),
                    lambda: (Request("shared-prefix", s.output_tokens, prompt=p) for p in prompts))


def long_doc_qa(s: Shape) -> Workload:
    """LMCache's long-document QA shape: a warm-up round sends every document once, then a
    query round asks about each document ``repeat_count`` times in ``repeat_mode`` order
    (tile: d0 d1 .. d0 d1 ..; interleave: d0 d0 .. d1 d1 ..; random: shuffled). Every
    request is its document followed by a fresh question."""
    rng = random.Random(f"long-doc-qa:{s.seed}")
    docs = [_tokens(rng, s.doc_tokens, s.vocab) for _ in range(s.docs)]
    order = {"tile": list(range(s.docs)) * s.repeat_count,
             "interleave": [d for d in range(s.docs) for _ in range(s.repeat_count)]}.get(s.repeat_mode)
    if order is None:
        order = list(range(s.docs)) * s.repeat_count
        rng.shuffle(order)
    plan = [("warmup", d) for d in range(s.docs)] + [("query", d) for d in order]
    prompts = [(phase, docs[d] + _tokens(rng, s.question_tokens, s.vocab)) for phase, d in plan]
    return Workload("long-doc-qa", len(prompts),
                    lambda: (Request(ph, s.output_tokens, prompt=p) for ph, p in prompts))


def multi_round_qa(s: Shape) -> Workload:
    """LMCache's multi-round QA shape: ``users`` users share a system prompt, each has its
    own context, and in every round each user asks one more question with the whole
    history before it. Rounds go one after another, users in turn within a round, so a
    user's history is reused after the other users' requests. The answer appended to the
    history is ``output_tokens`` drawn tokens, not the server's text, so the shape does
    not depend on the model's tokenizer."""
    rng = random.Random(f"multi-round-qa:{s.seed}")
    system = _tokens(rng, s.system_tokens, s.vocab)
    history = [system + _tokens(rng, s.user_tokens, s.vocab) for _ in range(s.users)]
    prompts = []
    for r in range(s.rounds):
        for u in range(s.users):
            history[u] = history[u] + _tokens(rng, s.question_tokens, s.vocab)
            prompts.append((f"round {r + 1}", history[u]))
            history[u] = history[u] + _tokens(rng, s.output_tokens, s.vocab)
    return Workload("multi-round-qa", len(prompts),
                    lambda: (Request(ph, s.output_tokens, prompt=p) for ph, p in prompts))


def load_conversations(path: str) -> list[tuple[str, list[dict]]]:
    """vLLM's multi-turn benchmark input: ``[{"id": str, "messages": [{"role", "content"}]}]``."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise WorkloadError(f"--conversations: cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise WorkloadError(f"--conversations: {path} is not JSON ({exc})") from None
    if not isinstance(data, list) or not data:
        raise WorkloadError(f"--conversations: {path} must hold a non-empty list of "
                            '{"id": ..., "messages": [...]} objects (vLLM\'s multi-turn format)')
    out = []
    for i, conv in enumerate(data):
        cid = conv.get("id", f"#{i}") if isinstance(conv, dict) else f"#{i}"
        msgs = conv.get("messages") if isinstance(conv, dict) else None
        ok = isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str) for m in msgs)
        if not ok or not any(m["role"] == "user" for m in msgs):
            raise WorkloadError(f"--conversations: conversation {cid} in {path} needs a 'messages' list "
                                "of {'role': system|user|assistant, 'content': text} with a user turn")
        out.append((str(cid), msgs))
    return out


def multi_turn(s: Shape) -> Workload:
    """vLLM's multi-turn conversation benchmark: every user message of every conversation
    is sent with the conversation so far, the file's assistant messages replaced by the
    server's own answers (as vLLM's benchmark does). Conversations take turns: turn 1 of
    each, then turn 2 of each, so a conversation's prefix is reused after the others."""
    if not s.conversations:
        raise WorkloadError("--workload multi-turn needs --conversations FILE (vLLM's multi-turn JSON: "
                            '[{"id": ..., "messages": [{"role": "user", "content": ...}, ...]}])')
    convs = load_conversations(s.conversations)
    turns = [[i for i, m in enumerate(msgs) if m["role"] == "user"] for _, msgs in convs]
    if s.max_turns:
        turns = [t[: s.max_turns] for t in turns]

    def requests() -> Iterator[Request]:
        history: list[list[dict]] = [[] for _ in convs]
        done = [0] * len(convs)  # messages of each conversation already in its history
        for t in range(max(len(x) for x in turns)):
            for c, (_, msgs) in enumerate(convs):
                if t >= len(turns[c]):
                    continue
                user = turns[c][t]
                # The file's system/user messages up to this turn; its assistant ones are
                # skipped because the server's answers already stand in for them.
                history[c] += [m for m in msgs[done[c]: user + 1] if m["role"] != "assistant"]
                done[c] = user + 1
                req = Request(f"turn {t + 1}", s.output_tokens, messages=list(history[c]))
                yield req
                history[c].append({"role": "assistant", "content": req.answer})

    return Workload("multi-turn", sum(map(len, turns)), requests)


WORKLOADS: dict[str, Callable[[Shape], Workload]] = {
    "shared-prefix": shared_prefix, "long-doc-qa": long_doc_qa,
    "multi-round-qa": multi_round_qa, "multi-turn": multi_turn}
