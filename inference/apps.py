from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"
    verbose_name = "Inference"

    def ready(self) -> None:
        from inference import checks  # noqa: F401  (registers the system checks)
        from inference import prediction_cache  # noqa: F401  (namespace bump on model promotion)
        from inference.served_targets import connect_invalidation as connect_served_target_invalidation
        from inference.worker import preload  # noqa: F401  (connects the worker_ready and worker_process_init handlers)

        connect_served_target_invalidation()  # a model version changed: drop the cached targets
