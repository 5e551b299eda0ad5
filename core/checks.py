"""The configuration check: what settings.py collected instead of failing at import time.

Ids are stable (``specops.E001`` a bad URL, ``specops.E002`` a pooler without a direct URL): they are
documented and operators silence them by id.
"""
from __future__ import annotations

from django.conf import settings
from django.core.checks import Error, Tags, register


@register(Tags.database, deploy=False)
def check_configuration(app_configs=None, **kwargs) -> list:
    """Report what settings.py collected instead of failing at import time."""
    return [Error(msg, hint=hint, id=check_id) for check_id, msg, hint in getattr(settings, "CONFIG_ERRORS", [])]
