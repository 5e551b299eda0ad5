"""What the batching loop reads of fencing (``sessions.runs``, where a run's fence and lease live).

``renew_leases`` extends the leases of the runs the loop holds and names those whose fence went
stale; ``SUPERSEDED`` is the status of a run a later run took over.
"""
from __future__ import annotations

from sessions.runs import SUPERSEDED, renew_leases

__all__ = ["SUPERSEDED", "renew_leases"]
