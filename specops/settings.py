"""SpecOps settings: everything comes from the environment (docs/configuration.md lists every variable).

Misconfiguration that Django can still boot with (a replica URL that does not parse, say) is
collected in ``CONFIG_ERRORS`` and reported by the system checks in ``core.checks``; a missing
SECRET_KEY with DEBUG off is refused at once, and so is a throttle rate that does not parse.

DEBUG is off unless the environment turns it on: a traceback page shows database hosts and
broker URLs. ``scripts/run.sh`` generates a SECRET_KEY once into ``var/secret_key``, which every
command on this checkout then reads (``SECRET_KEY_FILE``) unless ``SECRET_KEY`` is set.
"""
from __future__ import annotations

import re
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from inference.conf import SETTINGS as INFERENCE_SETTINGS
from metadata.conf import SETTINGS as METADATA_SETTINGS
from sessions.conf import SETTINGS as SESSION_SETTINGS
from core.conf import SETTINGS as PROJECT_SETTINGS
from core.conf_base import read_declared
from core.database_config import database_settings
from core.tracing import exporter_error

BASE_DIR = Path(__file__).resolve().parent.parent
INSECURE_SECRET_KEY = "insecure-dev-key-change-me"

env = environ.Env()
DEBUG = env.bool("DEBUG", default=False)
# Without SECRET_KEY in the environment, the key `make run` generated for this checkout (empty
# SECRET_KEY_FILE: no file); production sets SECRET_KEY itself.
SECRET_KEY_FILE = env.str("SECRET_KEY_FILE", default=str(BASE_DIR / "var" / "secret_key"))
SECRET_KEY = env.str("SECRET_KEY", default="")
if not SECRET_KEY and SECRET_KEY_FILE and Path(SECRET_KEY_FILE).is_file():
    SECRET_KEY = Path(SECRET_KEY_FILE).read_text().strip()
SECRET_KEY = SECRET_KEY or INSECURE_SECRET_KEY
if not DEBUG and SECRET_KEY == INSECURE_SECRET_KEY:
    raise ImproperlyConfigured("SECRET_KEY must be set to a secret value when DEBUG is off "
                               "(or run `make run` once: it writes var/secret_key).")
# A larger body is a JSON 413 that names this limit (core.middleware.BodySizeLimitMiddleware).
DATA_UPLOAD_MAX_MEMORY_SIZE = env.int("DATA_UPLOAD_MAX_MEMORY_SIZE", default=2_621_440)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])

CONFIG_ERRORS: list[tuple[str, str, str]] = []  # (check id, message, hint) for core.checks

DATABASES, DATABASE_REPLICAS = database_settings(
    primary_url=env.str("DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/specops"),
    replica_urls=env.str("DATABASE_REPLICA_URLS", default="postgres://postgres@127.0.0.1:5433/specops"),
    pool_max_size=env.int("DATABASE_POOL_MAX_SIZE", default=8),
    errors=CONFIG_ERRORS,
    # Maintenance that needs a session (advisory locks, CONCURRENTLY) when DATABASE_URL is PgBouncer.
    direct_url=env.str("DATABASE_DIRECT_URL", default=""),
)
DATABASE_ROUTERS = ["metadata.replicas.router.ReplicaRouter"]

REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": env.str("SPECOPS_CACHE_PREFIX", default="specops"),
        "OPTIONS": {
            "CLIENT_CLASS": "django_redis.client.DefaultClient",
            # JSON, not django-redis's default pickle: a value read from Redis never runs code here
            "SERIALIZER": "django_redis.serializers.json.JSONSerializer",
            "SOCKET_CONNECT_TIMEOUT": 0.25,
            "SOCKET_TIMEOUT": 0.25,
        },
    }
}


# App settings: each declared once, with its default, in its app's conf.py (docs/configuration.md lists them).
read_declared(env, globals(), (*METADATA_SETTINGS, *SESSION_SETTINGS, *INFERENCE_SETTINGS, *PROJECT_SETTINGS))
THROTTLE_RATE_PATTERN = r"(?i)none|[0-9]+/(s|sec|second|m|min|minute|h|hour|d|day)"
for _name in ("SPECOPS_THROTTLE_USER_RATE", "SPECOPS_THROTTLE_TENANT_RATE", "SPECOPS_THROTTLE_GENERATION_RATE",
              "SPECOPS_THROTTLE_LOGIN_RATE"):
    if not re.fullmatch(THROTTLE_RATE_PATTERN, globals()[_name].strip()):
        raise ImproperlyConfigured(f"{_name}={globals()[_name]!r}: expected <count>/<s|min|hour|day> "
                                   "(e.g. 600/min), or none.")
if exporter_error(SPECOPS_TRACING):  # noqa: F821 (declared above by read_declared)
    raise ImproperlyConfigured(exporter_error(SPECOPS_TRACING))  # noqa: F821

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served from the installed package (no CDN)
    "django_celery_beat",
    "django_prometheus",
    "core.apps.CoreConfig",
    "metadata",
    "sessions.apps.SessionsConfig",
    "inference",
    "ops.apps.OpsConfig",
]

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    # First after the metrics: a body over DATA_UPLOAD_MAX_MEMORY_SIZE is a JSON 413 before any work.
    "core.middleware.BodySizeLimitMiddleware",
    # Every statement of the request ends with /* specops:view=<url name> */ (pg_stat_statements).
    "metadata.insights.tagging.SqlTagMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "metadata.request_log.RequestLogMiddleware",
    # After the request log: its own write must not count as the client's write.
    "metadata.replicas.middleware.ReadYourWritesMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "specops.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    }
]
WSGI_APPLICATION = "specops.wsgi.application"
ASGI_APPLICATION = "specops.asgi.application"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "var" / "static"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # DRF's token authentication through the two-tier cache (token, user, membership, tenant)
        "metadata.api.authentication.CachedTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "core.api_errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
    # JSON that nests too deeply is a 400 naming the body, not a RecursionError 500.
    "DEFAULT_PARSER_CLASSES": [
        # JSON and forms (no files), held to the same text rules; anything else is a 415
        "core.parsers.JSONParser",
        "core.parsers.FormParser",
        "core.parsers.MultiPartParser",
    ],
    # Per token and per tenant, counted in Redis (the "default" cache); rates: SPECOPS_THROTTLE_*.
    "DEFAULT_THROTTLE_CLASSES": [
        "core.throttles.UserRateThrottle",
        "core.throttles.TenantRateThrottle",
    ],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "SpecOps API",
    "DESCRIPTION": "LLM generation with speculative decoding, and its session metadata.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # The schema and the docs need a signed-in caller (a token, or the admin's session): counted by
    # the per-user throttles, not by a spoofable X-Forwarded-For (core.schema_views).
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# Celery: the broker defaults to Redis; RabbitMQ works by setting CELERY_BROKER_URL.
CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default=REDIS_URL)
CELERY_RESULT_BACKEND = env.str("CELERY_RESULT_BACKEND", default=REDIS_URL)
CELERY_TASK_SOFT_TIME_LIMIT = env.int("CELERY_TASK_SOFT_TIME_LIMIT", default=300)
CELERY_TASK_TIME_LIMIT = env.int("CELERY_TASK_TIME_LIMIT", default=360)
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"

# Latency buckets with edges at the alert thresholds (20 ms DB, 300/600 ms API SLO).
PROMETHEUS_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.025, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 1, 2.5, 5, 10, float("inf"))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
}

# ---------------------------------------------------------------------------------------------
# Read path: replica routing with read-your-writes, two-tier cache, prediction cache
# (metadata/replicas/, metadata/cache/, sessions/submission/prediction_cache.py).
# The read-path caches' own django-redis alias: same Redis as "default", but a connection that
# fails at once instead of redis-py's default 10 retries with backoff (3.5 s a call while Redis is
# down); the caches then read from the database until Redis answers again.
from redis.backoff import NoBackoff
from redis.retry import Retry

CACHES["read_path"] = {
    **CACHES["default"],
    "OPTIONS": {**CACHES["default"]["OPTIONS"], "CONNECTION_POOL_KWARGS": {"retry": Retry(NoBackoff(), 0)}},
}
# ---------------------------------------------------------------------------------------------
