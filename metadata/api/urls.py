from rest_framework.routers import SimpleRouter

from metadata.api import views

router = SimpleRouter()
router.register("sessions", views.SessionViewSet, basename="session")
urlpatterns = router.urls
