"""The old path of ``variant_writer``, kept because ``bench/optimise.py`` imports it from here.

New code imports ``inference.engine.models.variant_writer``; this module goes once the benches do.
"""

from inference.engine.models.variant_writer import build_variant_dir, variant_dir_for

__all__ = ["build_variant_dir", "variant_dir_for"]
