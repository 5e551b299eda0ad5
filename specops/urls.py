from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from specops.ops.views import dashboard

urlpatterns = [
    path("admin/dashboard/", admin.site.admin_view(dashboard), name="specops-dashboard"),
    path("admin/", admin.site.urls),
    path("api/v1/", include("inference.api.urls")),
    path("api/v1/", include("metadata.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("", include("django_prometheus.urls")),
]
