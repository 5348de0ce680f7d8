"""bench/transitions.py's baseline: another git revision's scripts, run as that revision ran
them. A baseline measured in another job format, or by EVALSHA where it had a function
library, would credit the working tree with a difference it did not make."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from jobtier.store import format as job_format
from jobtier.store.scripts import NAMES

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
sys.path.insert(0, "bench")
import transitions
rev = transitions.git_sources("HEAD")
print(json.dumps({
    "format": transitions.known_format(rev),
    "functions": sorted(rev.library.functions) if rev.library else None,
    "texts": sorted(rev.texts),
}))
"""


def test_the_baseline_at_head_writes_the_newest_format_from_its_own_library() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["format"] == job_format.NEWEST
    assert found["functions"] == sorted(NAMES)
    assert found["texts"] == sorted([*NAMES, "read_status"])
