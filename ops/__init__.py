"""Operator views of the whole platform: the admin dashboard, its rollups and gauges.

``views`` holds the admin pages (``/admin/dashboard/``, ``/admin/latency-budget/``), filled by
``dashboard.dashboard_context`` from the per-minute and per-hour rollups that ``rollups`` writes
(``roll_up_ops``, a beat job every 30 s; API requests are rolled up on write by the request-log
middleware); ``gauges`` holds the beat task that sets the Prometheus gauges from ``readings``
(broker, DEFAULT partitions, replicas). Charts and histograms are ``core``'s.
"""
