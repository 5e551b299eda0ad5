from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularSwaggerView

from core.login_throttle import throttled_login
from core.metrics_view import metrics
from core.schema_views import CachedSpectacularAPIView
from ops.views import dashboard, latency_budget

# Errors are JSON in the called API's shape, never a traceback or an HTML page (core.error_views).
handler400 = "core.error_views.bad_request"
handler403 = "core.error_views.permission_denied"
handler404 = "core.error_views.page_not_found"
handler500 = "core.error_views.server_error"

urlpatterns = [
    path("admin/dashboard/", admin.site.admin_view(dashboard), name="specops-dashboard"),
    path("admin/latency-budget/", admin.site.admin_view(latency_budget), name="specops-latency-budget"),
    # sign-in attempts per address and per username: SPECOPS_THROTTLE_LOGIN_RATE (core.login_throttle)
    path("admin/login/", throttled_login(admin.site.login), name="specops-admin-login"),
    path("admin/", admin.site.urls),
    path("api/v1/", include("inference.api.urls")),
    path("api/v1/", include("sessions.api.urls")),
    path("v1/", include("inference.api.openai.urls")),  # the OpenAI-compatible protocol
    # signed-in callers only, the schema built once per process, Swagger UI from the package (core.schema_views)
    path("api/schema/", CachedSpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("metrics", metrics, name="prometheus-django-metrics"),  # a bearer token (core.metrics_view)
]
