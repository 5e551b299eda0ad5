"""Declared settings: each app lists its settings once (name, type, default, meaning) in its conf.py.

``specops/settings.py`` reads every declared setting from the environment with
``read_declared``; code reads them back through the app's ``conf`` object (``conf.NAME``), never
from ``django.conf.settings`` with a default of its own, so a default is written in exactly one place.
Hand-written rather than django-appconf: that package reads defaults from class attributes
but does not read the environment, and settings here come from the environment.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import environ


@dataclass(frozen=True)
class Setting:
    """One environment-backed setting; ``default`` may be a callable of the settings read so far."""

    name: str
    cast: Any
    default: Any
    help: str = ""

    def read(self, env: environ.Env, namespace: dict[str, Any]) -> Any:
        default = self.default(namespace) if callable(self.default) else self.default
        if self.cast is bool:
            return env.bool(self.name, default=default)
        value = env.get_value(self.name, cast=self.cast, default=default)
        return self.cast(value) if value is not None and not isinstance(value, self.cast) else value


def read_declared(env: environ.Env, namespace: dict[str, Any], declared: Iterable[Setting]) -> None:
    """Set every declared setting in ``namespace`` (the settings module's globals)."""
    for setting in declared:
        namespace[setting.name] = setting.read(env, namespace)


class AppSettings:
    """``conf.PARTITION_INTERVAL`` reads ``settings.SPECOPS_PARTITION_INTERVAL`` (declared, so always set)."""

    def __init__(self, declared: Iterable[Setting], prefix: str = "SPECOPS_") -> None:
        self._declared = {setting.name: setting for setting in declared}
        self._prefix = prefix

    def __getattr__(self, attribute: str) -> Any:
        from django.conf import settings

        name = attribute if attribute in self._declared else self._prefix + attribute
        if name not in self._declared:
            raise AttributeError(f"{attribute}: not a declared setting")
        return getattr(settings, name)

    def declared(self) -> list[Setting]:
        return list(self._declared.values())

