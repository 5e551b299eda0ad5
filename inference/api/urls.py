from rest_framework.routers import SimpleRouter

from inference.api import views

router = SimpleRouter()
router.register("generations", views.GenerationViewSet, basename="generation")
router.register("models", views.ModelVersionViewSet, basename="modelversion")
urlpatterns = router.urls
