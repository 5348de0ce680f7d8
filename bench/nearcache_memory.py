"""Benchmark: the near cache's memory, per 100K status documents.

Fills a ``NearCache`` (the API process's, ``JOBTIER_NEAR_CACHE_SIZE`` entries at most) with
documents shaped like jobtier's (a terminal job's, as rendered by lib.lua: ~330 bytes, ids of
the real length) and reads what it took: Python's allocations (``tracemalloc``: the ids, the
entries, the documents and the dict) and the process's RSS growth. Medians of ``--runs``
fills of a fresh cache, each in a fresh child process.

    .venv/bin/python bench/nearcache_memory.py
    .venv/bin/python bench/nearcache_memory.py --entries 100000 --runs 3

Results: bench/results/nearcache_memory.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, fmt, header_markdown, median, save, table

DOC = (
    '{"id":"%s","type":"resize_image","queue":"default","state":"succeeded","version":3,'
    '"priority":"normal","attempt":1,"max_attempts":3,"created_at":"2026-11-29T12:00:00.000Z",'
    '"updated_at":"2026-11-29T12:00:01.250Z","run_at":null,"progress":null,"error":null,'
    '"cancel_requested":false,"worker":null}'
)


def child(entries: int) -> dict[str, float]:
    import gc
    import tracemalloc

    from jobtier.core.keys import Keys
    from jobtier.status.nearcache import Entry, NearCache

    keys = Keys("jt", 16)
    ids = [keys.new_id(i % 16) for i in range(entries)]
    gc.collect()
    rss0 = _rss_kb()
    tracemalloc.start()
    cache = NearCache(maxsize=entries, ttl=2.0, final_ttl=3600.0)
    now = time.monotonic()
    for job_id in ids:
        # the reader stores the document bytes it received and a copy of the id string
        cache.put(str(job_id), Entry("tenant-1", 3, (DOC % job_id).encode(), now, True))
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    gc.collect()
    rss1 = _rss_kb()
    assert len(cache) == entries
    return {
        "python_bytes": float(current),
        "rss_bytes": float((rss1 - rss0) * 1024),
        "doc_bytes": float(len(DOC % ids[0])),
    }


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=100_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    env = environment()
    runs = []
    for _ in range(args.runs):
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(args.entries)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        runs.append(json.loads(out.stdout))
    per = 100_000 / args.entries
    s = {k: median([r[k] for r in runs]) for k in runs[0]}
    md = header_markdown("Near cache: memory per 100K status documents", env)
    md += (
        f"\n{args.entries:,} entries of {s['doc_bytes']:.0f}-byte documents (a finished job's, "
        f"real id length), medians of {args.runs} fresh processes.\n\n"
    )
    md += table(
        ["what", "per 100K documents", "per document"],
        [
            ["Python allocations (tracemalloc)", f"{fmt(s['python_bytes'] * per / 2**20, 1)} MiB",
             f"{fmt(s['python_bytes'] / args.entries)} B"],
            ["process RSS growth", f"{fmt(s['rss_bytes'] * per / 2**20, 1)} MiB",
             f"{fmt(s['rss_bytes'] / args.entries)} B"],
        ],
    ) + "\n"  # fmt: skip
    print(md)
    if not args.no_save:
        save("nearcache_memory", {"environment": env, "args": vars(args), "runs": runs}, md)


if __name__ == "__main__":
    main()
