"""Every bench program still imports against the package as it is: the benches are not part
of mypy's run, and a moved name would otherwise surface only when someone measures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_every_bench_program_imports() -> None:
    names = sorted(p.stem for p in BENCH.glob("*.py"))
    assert "compare" in names and "webhooks" in names
    # one fresh interpreter for all: importing runs each module's top level, not its main()
    code = (
        "import importlib, sys, traceback\n"
        "bad = []\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        bad.append(name + ': ' + traceback.format_exc(limit=1).strip().splitlines()[-1])\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=BENCH, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
