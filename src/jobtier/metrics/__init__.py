"""Metrics: every process publishes snapshots through Redis; the API serves them at ``/metrics``.

- ``histogram``: the histogram every part observes into, and the arithmetic on snapshots;
- ``snapshot``: the per-process snapshot, its publisher and its readers;
- ``transitions``: job counters by type, from what the persister commits;
- ``prometheus``: rendering for ``/metrics`` (the live gauges come from ``api/gauges.py``).

Each part builds its own snapshot (``metrics()``); a process hands its parts to one
``MetricsPublisher``.
"""
