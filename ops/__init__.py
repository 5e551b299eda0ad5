"""Operator views of the whole platform: the admin dashboard, its rollups and gauges.

``models`` holds ``OpsRollup``, the per-minute and per-hour rollups that ``rollups`` writes (the
``ops.roll_up_ops`` beat job, every 30 s) and ``request_rollups`` adds API requests to as the
request log records them. ``views`` holds the admin pages (``/admin/dashboard/``,
``/admin/latency-budget/``), filled by ``dashboard.dashboard_context`` from those rows.
``gauges`` sets the Prometheus gauges from ``readings`` (broker, DEFAULT partitions, replicas) for
the ``ops.sample_ops_metrics`` beat job; both beat tasks are in ``tasks``. Charts and histograms
are ``core``'s.
"""
