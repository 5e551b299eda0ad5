"""``/metrics`` for Prometheus only: a bearer token, never anonymous on the public port.

django-prometheus serves ``/metrics`` to anyone who can reach the API; its figures (routes,
request rates, models, queue depths, error counts) are for the operator. With
``SPECOPS_METRICS_TOKEN`` set, a scrape must send ``Authorization: Bearer <token>`` (Prometheus's
``authorization.credentials_file``; ``deploy/prometheus/prometheus.yml``); without it, ``/metrics``
is served only with ``DEBUG`` on (a developer's machine) and is a 404 otherwise. The exposition
itself is django-prometheus's view, which in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``)
carries every process's metrics of the host.
"""
from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django_prometheus.exports import ExportToDjangoView


def metrics(request: HttpRequest) -> HttpResponse:
    token = settings.SPECOPS_METRICS_TOKEN
    if not token:
        if settings.DEBUG:
            return ExportToDjangoView(request)
        return JsonResponse({"detail": "Not found.", "status": 404}, status=404)
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(credentials.strip().encode(), token.encode()):
        response = JsonResponse({"detail": "Authorization: expected Bearer and the metrics token "
                                           "(SPECOPS_METRICS_TOKEN).", "status": 401}, status=401)
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return ExportToDjangoView(request)
