"""SQL tags: every statement says which view or task sent it, as ``/* specops:view=… */``.

pg_stat_statements keeps the text of the first statement it saw for each query id, comment
included, so the hot-queries page can name the code behind a statement (the first caller, when
several send the same statement). The tag is appended, not prepended: other execute wrappers
(the replica router's write marker) read a statement's first word.

- ``SqlTagMiddleware`` tags the statements of a request with its URL name (``view=…``).
- Celery's ``task_prerun``/``task_postrun`` tag a task's statements with its name (``task=…``).
- In a worker process, statements outside any task (the device's batching loop thread) carry
  the thread's name (``task=thread:specops-batching-loop``).
- ``sql_tag("command", "partitions")`` tags a block by hand.

The wrapper is installed on every connection when it is made (``connection_created``), and is a
no-op (one context-variable read) when nothing is tagged.
"""
from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar, Token
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.db import connections
from django.db.backends.signals import connection_created

UNSAFE = re.compile(r"[^A-Za-z0-9_.:=-]+")
TAG_MAX = 120

# The current tag: a string, or a callable that works it out on first use (a request's view is
# resolved only when its first statement runs, often after the URL was resolved anyway).
_current: ContextVar[str | Callable[[], str] | None] = ContextVar("specops_sql_tag", default=None)
_in_worker = threading.Event()  # set in Celery worker processes


def clean(kind: str, name: str) -> str:
    """``kind=name`` with anything that could end a comment or a parameter marker removed."""
    return f"{kind}={UNSAFE.sub('-', name)}"[:TAG_MAX]


def current_tag() -> str | None:
    value = _current.get()
    if callable(value):
        value = value()
    if value is None and _in_worker.is_set():
        return clean("task", f"thread:{threading.current_thread().name}")
    return value


def tag_statement(execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: dict) -> Any:
    """Execute wrapper: append the current tag to the statement as a comment."""
    tag = current_tag()
    if tag and isinstance(sql, str):
        sql = f"{sql} /* specops:{tag} */"
    return execute(sql, params, many, context)


def install(connection) -> None:
    if tag_statement not in connection.execute_wrappers:
        connection.execute_wrappers.append(tag_statement)


def _on_connection_created(sender, connection, **kwargs) -> None:
    install(connection)


@contextlib.contextmanager
def sql_tag(kind: str, name: str) -> Iterator[None]:
    """Tag the statements of the block (this thread or task only)."""
    for connection in connections.all(initialized_only=True):
        install(connection)
    token = _current.set(clean(kind, name))
    try:
        yield
    finally:
        _current.reset(token)


def view_tag(request) -> str:
    """``view=<URL name>`` (namespaced), else the view's dotted path; resolved on demand."""
    from django.urls import Resolver404, resolve

    cached = getattr(request, "_specops_sql_tag", None)
    if cached:
        return cached
    match = getattr(request, "resolver_match", None)
    if match is None:
        try:
            match = resolve(request.path_info)
        except Resolver404:
            return clean("view", "not-found")
    name = match.view_name or f"{match.func.__module__}.{getattr(match.func, '__qualname__', 'view')}"
    request._specops_sql_tag = clean("view", name)
    return request._specops_sql_tag


class SqlTagMiddleware:
    """Tag every statement of a request with its view (works for sync and async views)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response) -> None:
        self.get_response = get_response
        if iscoroutinefunction(self.get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        token = _current.set(lambda: view_tag(request))
        try:
            return self.get_response(request)
        finally:
            _current.reset(token)

    async def __acall__(self, request):
        token = _current.set(lambda: view_tag(request))
        try:
            return await self.get_response(request)
        finally:
            _current.reset(token)


# ------------------------------------------------------------------ Celery
_task_tokens: dict[str, Token] = {}


def _task_started(task_id: str | None = None, task=None, **kwargs) -> None:
    if task_id and task is not None:
        _task_tokens[task_id] = _current.set(clean("task", task.name))


def _task_finished(task_id: str | None = None, **kwargs) -> None:
    token = _task_tokens.pop(task_id, None) if task_id else None
    if token is not None:
        try:
            _current.reset(token)
        except ValueError:  # finished in another context than it started (not with our pools)
            _current.set(None)


def _worker_started(**kwargs) -> None:
    _in_worker.set()


def connect_signals() -> None:
    """Install the wrapper on new connections and follow Celery tasks (idempotent)."""
    from celery.signals import task_postrun, task_prerun, worker_init, worker_process_init

    connection_created.connect(_on_connection_created, dispatch_uid="specops_sql_tag")
    task_prerun.connect(_task_started, dispatch_uid="specops_sql_tag_task_prerun", weak=False)
    task_postrun.connect(_task_finished, dispatch_uid="specops_sql_tag_task_postrun", weak=False)
    worker_init.connect(_worker_started, dispatch_uid="specops_sql_tag_worker_init", weak=False)
    worker_process_init.connect(_worker_started, dispatch_uid="specops_sql_tag_worker_process_init", weak=False)


connect_signals()
