"""Metrics: every process publishes through Redis; the API serves them all at ``/metrics``.

- ``histogram``: the histogram every part observes into, and the arithmetic on snapshots;
- ``snapshot``: the per-process snapshot, its publisher and its readers;
- ``transitions``: job counters by type, from what the persister commits;
- ``prometheus``: rendering for ``/metrics``;
- ``gauges``: what is read from Redis at scrape time.

Each part (worker, scheduler, persister, status reader) builds its own snapshot in its
``metrics()`` method; a process hands its parts to one ``MetricsPublisher``.
"""
