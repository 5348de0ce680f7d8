"""Every action the API records in its audit (``audited(request, "<action>", …)``) has words
in the console's audit view (static/audit.js ACTION_WORDS): an action without them showed as
its raw name (breaker.open and breaker.close did)."""

from __future__ import annotations

import re
from pathlib import Path

from jobtier.core.names import AUDIT_ACTIONS

API = Path(__file__).resolve().parents[2] / "src" / "jobtier" / "api"


def test_every_audited_action_has_words_in_the_console() -> None:
    actions = {
        name
        for path in API.glob("*.py")
        for pair in re.findall(
            # audited(request, "<action>", …), or console.py's _changed(request, "<action>", …)
            r'(?:audited|_changed)\(\s*request,\s*("[^"]+")(?:\s+if\s+\w+\s+else\s+("[^"]+"))?',
            path.read_text(),
        )
        for name in pair
        if name
    }
    script = (API / "static" / "audit.js").read_text()
    table = script[
        script.index("const ACTION_WORDS = {") : script.index(
            "};", script.index("const ACTION_WORDS")
        )
    ]
    words = set(re.findall(r'"([a-z_]+\.[a-z_]+)":', table))
    actions = {a.strip('"') for a in actions}
    assert {"job.cancel", "queue.pause", "queue.resume", "breaker.open"} <= actions  # it reads them
    assert actions <= words, f"audited actions the console has no words for: {actions - words}"
    # the list the audit listing takes, the CLI offers and the docs name is the code's
    assert set(AUDIT_ACTIONS) == actions and len(AUDIT_ACTIONS) == len(actions)
