"""The OpenAPI schema and its Swagger UI, for authenticated callers, the schema built once per process.

drf-spectacular rebuilds the schema on every request (it walks every URL pattern and serializer:
hundreds of milliseconds), and serves it to anyone by default; an anonymous caller was then
throttled on ``X-Forwarded-For``, which any client sets. Here both views need a signed-in caller
(``SPECTACULAR_SETTINGS["SERVE_PERMISSIONS"]``: a DRF token, or the admin's session for the
browser), so the per-user throttles count them, and the schema is generated once per process,
version and language: it changes only when the code does (``SERVE_PUBLIC``: the same schema for
every caller, whoever asked first). Swagger UI's files come from the
installed ``drf_spectacular_sidecar`` package (``SWAGGER_UI_DIST = "SIDECAR"``), not a CDN.
"""
from __future__ import annotations

from threading import Lock
from typing import Any

from django.utils import translation
from drf_spectacular.views import SpectacularAPIView
from rest_framework.response import Response

_schemas: dict[tuple[Any, ...], dict] = {}
_lock = Lock()


class CachedSpectacularAPIView(SpectacularAPIView):
    """drf-spectacular's schema view; the schema is generated once per (version, language)."""

    def _get_schema_response(self, request) -> Response:
        version = self.api_version or request.version or self._get_version_parameter(request)
        key = (self.urlconf, version, translation.get_language(), self.serve_public)
        schema = _schemas.get(key)
        if schema is None:
            with _lock:
                schema = _schemas.get(key)
                if schema is None:
                    generator = self.generator_class(urlconf=self.urlconf, api_version=version,
                                                     patterns=self.patterns)
                    schema = _schemas[key] = generator.get_schema(request=request, public=self.serve_public)
        return Response(data=schema, headers={
            "Content-Disposition": f'inline; filename="{self._get_filename(request, version)}"'})
