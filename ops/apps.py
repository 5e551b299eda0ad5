from django.apps import AppConfig


class OpsConfig(AppConfig):
    """Operator views of the whole platform: the dashboard, its rollups and gauges."""

    name = "ops"
    verbose_name = "Operations"

    def ready(self) -> None:
        from core.beat_jobs import declare_jobs
        from metadata.request_log import request_logged
        from ops import tasks  # its beat tasks must be known wherever beat jobs are routed
        from ops.request_rollups import add_logged_request

        declare_jobs("ops", tasks.periodic_jobs)

        # API requests are rolled up as they are logged (the request log is metadata's).
        request_logged.connect(add_logged_request, dispatch_uid="ops_request_rollups")
