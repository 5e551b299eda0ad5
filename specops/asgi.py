"""The ASGI application: what gunicorn's uvicorn workers (scripts/run.sh) and uvicorn serve.

Async views (the SSE streams, the OpenAI protocol) run on the event loop; sync views run in
Django's thread pool.
"""
import os

from django.core.asgi import get_asgi_application

from core.body_limit import BodyLimit
from core.tracing import configure_tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "specops.settings")
# Before the application loads its middleware: the Django instrumentation inserts its own.
configure_tracing("specops-web")
# BodyLimit refuses an oversized body at its declared length, or cuts a chunked one off, before
# Django reads it whole (core/body_limit.py)
application = BodyLimit(get_asgi_application())
