from django.urls import path
from rest_framework.routers import SimpleRouter

from sessions.api import views

router = SimpleRouter()
router.register("sessions", views.SessionViewSet, basename="session")
urlpatterns = [
    # A plain async view, not a viewset action: an open stream must not hold a thread.
    path("sessions/<uuid:pk>/stream/", views.session_stream, name="session-stream"),
    *router.urls,
]
