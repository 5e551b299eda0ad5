from django.apps import AppConfig


class SessionsConfig(AppConfig):
    """A session's life: admission, submission, runs, its end, its cached state and its stream.

    Labelled ``specops_sessions``: Django's own login sessions hold the label ``sessions``.
    """

    name = "sessions"
    label = "specops_sessions"
    verbose_name = "Generation sessions"

    def ready(self) -> None:
        from sessions.state import cache  # noqa: F401  (a Session saved or deleted drops its cached state)
        from sessions.submission import prediction_cache  # noqa: F401  (a promotion drops the replaced versions' predictions)
