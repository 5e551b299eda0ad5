"""The partitioned request log: every authenticated API request, written in batches off the request path.

``RequestLogMiddleware`` (in ``MIDDLEWARE``) logs each request through ``RequestLogWriter`` and
announces it (``request_logged``), so the operators' views count it without this app knowing them.
"""
from __future__ import annotations

from metadata.request_log.middleware import RequestLogMiddleware, RequestLogWriter, request_logged

__all__ = ["RequestLogMiddleware", "RequestLogWriter", "request_logged"]
