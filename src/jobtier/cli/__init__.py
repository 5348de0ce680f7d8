"""The ``jobtier`` command.

``entry`` is its entry point (the console script's and ``python -m jobtier.cli``'s): it loads
the commands, which takes a moment (Redis, Postgres and HTTP clients, the worker), and a
Ctrl-C meanwhile ends the command as a Ctrl-C does, without the traceback of whichever import
it interrupted. Once loaded, each command answers signals its own way (cli/main.py).
"""

from __future__ import annotations

import os
import signal


def entry() -> int:
    try:
        from jobtier.cli.main import main as run
    except KeyboardInterrupt:
        # ended by the signal, as an uninterrupted Ctrl-C would have: its parent sees SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        # still here where the default action does nothing (PID 1 in a container without an
        # init): the status a shell gives a command a Ctrl-C ended
        return 128 + signal.SIGINT
    return run()
