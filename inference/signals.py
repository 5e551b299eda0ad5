"""Signals of the inference app (the prediction cache listens to promotions)."""
from django.dispatch import Signal

# Sent after commit with ``version`` (the newly active ModelVersion) and ``replaced`` (a list).
model_promoted = Signal()
