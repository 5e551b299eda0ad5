from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"
    verbose_name = "Inference"

    def ready(self) -> None:
        from core.beat_jobs import declare_jobs
        from inference import affinity, tasks
        from inference import checks  # noqa: F401  (registers the system checks)
        from inference.served_targets import connect_invalidation as connect_served_target_invalidation
        from inference.worker import preload  # noqa: F401  (connects the worker_ready and worker_process_init handlers)
        from sessions.submission import route_with
        from sessions.tasks import run_with

        declare_jobs("inference", tasks.periodic_jobs)
        connect_served_target_invalidation()  # a model version changed: drop the cached targets
        run_with(tasks.run_generation)  # a device worker runs the sessions its queue hands it
        route_with(affinity.route_session)  # a prompt extending a recent one goes where its prefix is cached
