"""Names of the files the engine reads in a model directory, apart from the code that reads them.

Here, with no import, so that a process which only checks that a version's files are on its host
(``inference.version_files``, in every Django start) names them without loading torch.
"""
from __future__ import annotations

VARIANT_FILE = "specops_variant.json"  # a variant's recipe (``inference.engine.lm.variants.recipes``)
