"""Locust users for bench/console.py: operators paging through the console's job listing.

Loaded beside loadtest/locustfile.py (``locust -f loadtest/locustfile.py,bench/console_locust.py
Poller Submitter ConsoleUser``). Each operator asks for a page of ``GET /v1/admin/jobs`` every
second (the page's pace when a person clicks through filters, or a dozen open pages
refreshing), with a filter drawn from ``LOADTEST_CONSOLE_FILTERS`` (a JSON list of query
parameter objects); one request in five follows the previous answer's ``next_cursor``.

LOADTEST_ADMIN_KEY        the admin key (required)
LOADTEST_CONSOLE_FILTERS  JSON list of {parameter: value} (default: no filter)
LOADTEST_OPERATORS        how many operators, whatever the other users (default: by weight)
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from locust import FastHttpUser, constant, task

ADMIN_KEY = os.environ.get("LOADTEST_ADMIN_KEY", "")
FILTERS: list[dict[str, Any]] = json.loads(os.environ.get("LOADTEST_CONSOLE_FILTERS") or "[{}]")


class ConsoleUser(FastHttpUser):
    """An operator's page: a filtered page of jobs every second, sometimes the next one."""

    fixed_count = int(os.environ.get("LOADTEST_OPERATORS", "0"))
    weight = 10
    wait_time = constant(1.0)

    def on_start(self) -> None:
        if not ADMIN_KEY:
            raise SystemExit("console_locust: set LOADTEST_ADMIN_KEY to the admin key")
        self.cursor: str | None = None
        self.last: dict[str, Any] = {}

    @task
    def list_jobs(self) -> None:
        if self.cursor and random.random() < 0.2:
            params = {**self.last, "cursor": self.cursor}
        else:
            self.last = dict(random.choice(FILTERS))
            params = dict(self.last)
        params["limit"] = 50
        with self.client.get(
            "/v1/admin/jobs",
            params=params,
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            name="GET /v1/admin/jobs",
            catch_response=True,
        ) as r:
            if r.status_code != 200:
                r.failure(f"status {r.status_code}: {(r.text or '')[:200]}")
                return
            self.cursor = r.json().get("next_cursor")
            r.success()
