"""What a ``pg_stat_statements`` text says: its normalised form, its family, the code that sent it.

pg_stat_statements already replaces constants by ``$n``; this module also removes the SpecOps
SQL tag (``/* specops:view=… */``, see ``metadata.insights.tagging``), collapses whitespace, and
folds lists of parameters (``IN ($1, $2, $3)``, multi-row ``VALUES``) to ``(...)``, so that one
statement sent with lists of different lengths reads as one. The *family* is the statement's kind
and main table (``select metadata_token``), with a partition folded into its parent table: the
unit of the latency heatmap and of the capacity plan.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

TAG_RE = re.compile(r"/\*\s*specops:(?P<tag>[^*]*?)\s*\*/")
PARAM_LIST_RE = re.compile(r"\(\s*\$\d+(?:\s*,\s*\$\d+)+\s*\)")
ROW_LIST_RE = re.compile(r"\(\.\.\.\)(?:\s*,\s*\(\.\.\.\))+|\(\$\d+\)(?:\s*,\s*\(\$\d+\))+")
PARAM_RE = re.compile(r"\$(\d+)")
WORD_RE = re.compile(r'"(?:[^"]|"")*"|\'(?:[^\']|\'\')*\'|[A-Za-z_][A-Za-z0-9_$]*|\S')
KINDS = ("select", "insert", "update", "delete", "merge")
QUERY_TEXT_MAX = 8000


@dataclass(frozen=True)
class StatementText:
    query: str  # normalised, for people and for grouping
    family: str  # e.g. "select metadata_session", "insert metadata_token", "select pg_try_advisory_lock"
    kind: str  # "select", "insert", ..., or the first word of anything else ("set", "begin")
    source: str  # "view=api:session-detail", "task=metadata.tasks.rotate_partitions", or ""


def source_of(text: str) -> str:
    match = TAG_RE.search(text)
    return match.group("tag") if match else ""


def normalise(text: str) -> str:
    """The statement without its tag, on one line, with parameter lists folded to ``(...)``."""
    text = " ".join(TAG_RE.sub(" ", text).split())
    text = PARAM_LIST_RE.sub("(...)", text)
    text = ROW_LIST_RE.sub("(...)", text)
    return text[:QUERY_TEXT_MAX]


def parameter_count(text: str) -> int:
    """The highest ``$n`` in the text: how many parameters a PREPARE of it takes."""
    return max((int(n) for n in PARAM_RE.findall(text)), default=0)


def _identifier(token: str) -> str:
    return token[1:-1].replace('""', '"') if token.startswith('"') else token.lower()


def _top_level_words(text: str) -> list[str]:
    """The words outside parentheses and literals, lower-cased (identifiers unquoted)."""
    words, depth = [], 0
    for token in WORD_RE.findall(text):
        if token == "(":
            depth += 1
        elif token == ")":
            depth = max(depth - 1, 0)
        elif depth == 0 and not token.startswith("'"):
            words.append(token)
    return words


def _qualified(words: list[str], i: int) -> str | None:
    """The relation name starting at ``words[i]`` (``schema.table`` keeps the table; ``ONLY`` skipped)."""
    if i < len(words) and words[i].lower() == "only":
        i += 1
    if i >= len(words) or not (words[i][0].isalpha() or words[i][0] in '_"'):
        return None
    name = _identifier(words[i])
    while i + 2 < len(words) and words[i + 1] == ".":
        i += 2
        name = _identifier(words[i])
    return name


def _main_statement(words: list[str]) -> int:
    """Index of the statement's own verb: after a ``WITH`` list, the first top-level verb."""
    for i, word in enumerate(words):
        if word.lower() in KINDS:
            return i
    return 0


def _function_after(text: str) -> str | None:
    match = re.match(r"\s*select\s+([A-Za-z_][A-Za-z0-9_.]*)\s*\(", text, re.IGNORECASE)
    return match.group(1).lower() if match else None


def family_of(text: str, parents: tuple[str, ...] = ()) -> tuple[str, str]:
    """(family, kind) of a statement; ``parents`` are partitioned tables a partition name folds into."""
    text = TAG_RE.sub(" ", text)
    words = _top_level_words(text)
    if not words:
        return "empty", "empty"
    start = _main_statement(words)
    kind = words[start].lower()
    table = None
    lowered = [w.lower() if not w.startswith('"') else w for w in words]
    if kind == "select" or kind == "delete":
        if "from" in lowered[start:]:
            table = _qualified(words, lowered.index("from", start) + 1)
        elif kind == "select":
            table = _function_after(text)
    elif kind == "insert" and "into" in lowered[start:]:
        table = _qualified(words, lowered.index("into", start) + 1)
    elif kind == "update":
        table = _qualified(words, start + 1)
    elif kind == "merge" and "into" in lowered[start:]:
        table = _qualified(words, lowered.index("into", start) + 1)
    if kind not in KINDS:
        return kind, kind
    if table:
        table = next((p for p in parents if table == p or table.startswith(p + "_")), table)
    return (f"{kind} {table}" if table else kind)[:100], kind


def describe(text: str, parents: tuple[str, ...] = ()) -> StatementText:
    family, kind = family_of(text, parents)
    return StatementText(query=normalise(text), family=family, kind=kind, source=source_of(text)[:200])
