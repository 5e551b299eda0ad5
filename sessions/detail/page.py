"""What the admin's session page shows: coloured tokens, per-step draft trees, acceptance, timings.

Read-only by design: everything here reads the session's own rows (its tokens by primary key,
its candidates by ``(session, step)``, both pruned to its partition by ``session_created_at``).
Steps are paged by keyset on the step number (``?steps=<cursor>``), never by OFFSET; a cursor
this page did not issue (edited, truncated, of another list's shape) shows the first page.

A step's candidates are its drafted root-to-leaf branches; merged on their common prefixes they
are the draft tree. The target walked it from the root and kept ``accepted_len`` tokens of the
best branch: those nodes are the accepted path; the children of its last node are where the
target rejected the draft; the step's last token (a correction, or a bonus when the whole branch
was accepted) is the target's own.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from django.urls import reverse
from rest_framework.exceptions import ValidationError

from metadata.api.pagination import decode_cursor, encode_cursor
from metadata.models import LIVE_STATUSES, Candidate, Session, TokenKind, TokenRecord
from sessions.detail.timings import timings_of
from core.charts import Series, bar_chart

STEPS_PER_PAGE = 20
KIND_CSS = {TokenKind.TARGET: "plain", TokenKind.ACCEPTED: "accepted", TokenKind.BONUS: "bonus",
            TokenKind.CORRECTION: "correction"}
Decoder = Callable[[int], str]


@dataclass
class TreeNode:
    token_id: int
    depth: int
    text: str = ""
    state: str = "not-taken"  # accepted | rejected | not-taken
    branches: list[int] = field(default_factory=list)
    score: float | None = None
    children: list[TreeNode] = field(default_factory=list)

    @property
    def title(self) -> str:
        branches = ", ".join(map(str, self.branches))
        score = f" · best score {self.score:.3f}" if self.score is not None else ""
        return f"depth {self.depth} · token {self.token_id} · branch {branches}{score} · {self.state.replace('-', ' ')}"


@dataclass
class StepView:
    step: int
    tokens: list[dict]
    roots: list[TreeNode]
    branches: int
    drafted_depth: int
    accepted: int

    @property
    def outcome(self) -> str:
        if not self.branches:
            return "no draft: the target's own token"
        if self.accepted >= self.drafted_depth:
            return f"all {self.drafted_depth} drafted positions accepted, then a bonus token"
        return f"accepted {self.accepted} of {self.drafted_depth} positions; rejected at depth {self.accepted + 1}"


def token_view(token: TokenRecord) -> dict:
    kind = TokenKind(token.kind)
    logprob = f" · log-prob {token.logprob:.3f}" if token.logprob is not None else ""
    return {"position": token.position, "step": token.step, "piece": token.piece, "css": KIND_CSS[kind],
            "kind": kind.label, "title": f"position {token.position} · step {token.step} · {kind.label}{logprob}"}


def draft_tree(candidates: list[Candidate], decode: Decoder) -> tuple[list[TreeNode], int, int]:
    """(roots, deepest drafted depth, accepted length) of one step's branches."""
    roots: list[TreeNode] = []
    if not candidates:
        return roots, 0, 0
    best = max(candidates, key=lambda c: (c.accepted_len, c.score))
    accepted_path = list(best.token_ids[: best.accepted_len])
    for candidate in sorted(candidates, key=lambda c: c.branch):
        level = roots
        for depth, token_id in enumerate(candidate.token_ids, start=1):
            node = next((n for n in level if n.token_id == token_id), None)
            if node is None:
                node = TreeNode(token_id, depth, decode(token_id))
                level.append(node)
            node.branches.append(candidate.branch)
            node.score = candidate.score if node.score is None else max(node.score, candidate.score)
            level = node.children
    _mark(roots, accepted_path, on_path=True)
    return roots, max(len(c.token_ids) for c in candidates), best.accepted_len


def _mark(level: list[TreeNode], path: list[int], on_path: bool) -> None:
    depth = level[0].depth if level else 0
    for node in level:
        if on_path and depth <= len(path) and node.token_id == path[depth - 1]:
            node.state = "accepted"
            _mark(node.children, path, on_path=True)
        else:
            # the first node off the accepted path, under its last node, is where the target said no
            node.state = "rejected" if on_path and depth == len(path) + 1 else "not-taken"
            _mark(node.children, path, on_path=False)


MAX_STEP = 2**31 - 1  # the step column's range


def steps_after(cursor: str | None) -> int:
    """The step a page of steps starts after: the cursor's, or -1 (the first page) for none or a
    cursor this page did not issue."""
    if not cursor:
        return -1
    try:
        value = decode_cursor(cursor, 1)[0]
    except ValidationError:
        return -1
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= MAX_STEP:
        return -1
    return value


def steps_page(session: Session, tokens: list[dict], cursor: str | None, decode: Decoder,
               per_page: int = STEPS_PER_PAGE) -> dict:
    """One page of steps after ``cursor`` (keyset on the step number), with their trees."""
    after = steps_after(cursor)
    last_step = tokens[-1]["step"] if tokens else -1
    upto = after + per_page
    rows = list(Candidate.objects.filter(session_id=session.pk, session_created_at=session.created_at,
                                         step__gt=after, step__lte=upto).order_by("step", "branch"))
    by_step: dict[int, list[Candidate]] = {}
    for row in rows:
        by_step.setdefault(row.step, []).append(row)
    steps = []
    for step in range(after + 1, min(upto, last_step) + 1):
        roots, depth, accepted = draft_tree(by_step.get(step, []), decode)
        steps.append(StepView(step, [t for t in tokens if t["step"] == step], roots, len(by_step.get(step, [])),
                              depth, accepted))
    return {"steps": steps, "steps_total": last_step + 1,
            "next_cursor": encode_cursor([upto]) if upto < last_step else None,
            "previous_cursor": (encode_cursor([after - per_page]) if after - per_page >= 0 else "")
            if after >= 0 else None}


def acceptance_chart(stats: dict) -> str:
    drafted = stats.get("drafted_per_position") or []
    rates = stats.get("acceptance_per_position") or [a / d if d else 0.0 for d, a in
                                                     zip(drafted, stats.get("accepted_per_position") or [])]
    points = [(f"{i + 1}", 100.0 * rate) for i, rate in enumerate(rates)]
    return bar_chart(Series("P(accepted | drafted) by draft position", points), "%", top=100.0,
                     title="Per-position acceptance")


def timing_rows(session: Session) -> list[tuple[str, str]]:
    timings = timings_of(session)
    stats = session.stats or {}

    def seconds(value) -> str:
        return "—" if value is None else (f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s")

    source = {"stats": "recorded by the worker", "stream": "from the token stream's entry times",
              "none": "not recorded (the token stream has expired)"}[timings.source]
    attempts = getattr(session, "attempts", None)
    worker = getattr(session, "worker", "")
    tokens_per_s = stats.get("tokens_per_second")
    return [
        ("Queue wait (created → worker started)", seconds(timings.queue_seconds)),
        ("Time to first token", f"{seconds(timings.ttft_seconds)} ({source})"),
        ("Inter-token latency (mean per token)", seconds(timings.itl_mean_seconds)),
        ("End to end (created → finished)", seconds(timings.e2e_seconds)),
        ("Draft time", seconds(stats.get("draft_seconds"))),
        ("Verify time", seconds(stats.get("verify_seconds"))),
        ("Generation time (engine)", seconds(stats.get("total_seconds"))),
        ("Tokens per second (engine)", f"{tokens_per_s:.1f}" if tokens_per_s else "—"),
        ("Attempts (claims by a worker: the run and each resume)",
         "not claimed yet" if not attempts else f"{attempts}{' (resumed)' if attempts > 1 else ''}"
         + (f" · last by {worker}" if worker else "")),
    ]


def links(session: Session) -> list[tuple[str, str]]:
    out = [(f"target model {session.target}", reverse("admin:metadata_modelversion_change", args=[session.target_id]))]
    if session.draft_id:
        out.append((f"draft model {session.draft}", reverse("admin:metadata_modelversion_change",
                                                            args=[session.draft_id])))
    api = f"/api/v1/sessions/{session.pk}"
    out += [("tokens (API)", f"{api}/tokens/"), ("candidates (API)", f"{api}/candidates/"),
            ("live stream (API, server-sent events)", f"{api}/stream/")]
    return out


def pieces_decoder(tokens: list[TokenRecord]) -> Decoder:
    """Decode from the session's own token rows (a drafted token the target never emitted shows its id)."""
    pieces = {t.token_id: t.piece for t in tokens}
    return lambda token_id: pieces.get(token_id, f"#{token_id}")


# The speculation of a session, as the admin's session page lists it: what was drafted and kept,
# and, where the verification scheduler chose the lengths, how many positions each step
# verified (verified_lengths[L]: steps that verified L) and how its survival estimates compared with
# what was accepted (survival_calibration = accepted / expected; 1: calibrated).
STATS_SHOWN = ("drafter", "steps", "drafted", "accepted", "acceptance_rate", "mean_accepted_length",
               "batch_rows_max", "depth_choices", "verified_lengths", "expected_accepted",
               "scheduled_accepted", "survival_calibration", "cut_tokens")


def session_context(session: Session, cursor: str | None, decoder: Callable[[list], Decoder] = pieces_decoder) -> dict:
    rows = list(TokenRecord.objects.filter(session_id=session.pk, session_created_at=session.created_at)
                .order_by("position").only("position", "step", "token_id", "piece", "kind", "logprob"))
    tokens = [token_view(t) for t in rows]
    counts = {label: 0 for label in TokenKind.labels}
    for token in tokens:
        counts[token["kind"]] += 1
    stats = session.stats or {}
    return {
        "session": session,
        "tokens": tokens,
        "kind_counts": counts,
        "is_live": session.status in LIVE_STATUSES,
        "acceptance_chart": acceptance_chart(stats) if stats.get("drafted_per_position") else "",
        "timing_rows": timing_rows(session),
        "links": links(session),
        "stats_rows": [(k, stats[k]) for k in STATS_SHOWN if k in stats],
        **steps_page(session, tokens, cursor, decoder(rows)),
    }
