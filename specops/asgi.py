"""The ASGI application: what gunicorn's uvicorn workers (scripts/run.sh) and uvicorn serve.

Async views (the SSE streams, the OpenAI protocol) run on the event loop through Django's ASGI
handler; sync views (the REST API, the admin) run through its WSGI handler in one thread hop
(``core.view_mode_router``).
"""
import os

from django.core.asgi import get_asgi_application
from django.core.wsgi import get_wsgi_application

from core.body_limit import BodyLimit
from core.long_lived import freeze_long_lived
from core.tracing import configure_tracing
from core.view_mode_router import ViewModeRouter

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "specops.settings")
# Before the application loads its middleware: the Django instrumentation inserts its own.
configure_tracing("specops-web")
django_asgi, django_wsgi = get_asgi_application(), get_wsgi_application()
from metadata.api.credentials import credentials_valid  # noqa: E402  (needs the apps loaded)
from django.urls import get_resolver  # noqa: E402
from inference.tokenizers import load_transformers  # noqa: E402

# Loaded now, not by the first request: every view, and transformers with torch (seconds; a
# Django start that never tokenizes leaves them out, inference/tokenizers.py). Then frozen below.
get_resolver().url_patterns
load_transformers()

# BodyLimit refuses an oversized body at its declared length, or cuts a chunked one off, before
# Django reads it whole, and reads at most 64 KiB of a request without valid credentials
# (core/body_limit.py)
application = BodyLimit(ViewModeRouter(django_asgi, django_wsgi), credentials_valid=credentials_valid)
# Django, DRF and the tokenizers' modules (with torch) live as long as the process: out of every
# full collection from now on (core/long_lived.py)
freeze_long_lived("web process")
