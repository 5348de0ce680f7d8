"""Flows: jobs that wait for others — dependencies, fan-in, chains — and their resolution.

``build`` makes flows (``chain``, ``fan_in``); ``plan`` checks one and lays it out;
``submit`` creates it in an order that is safe to cut short; the resolver
(``resolver.py``, run by the scheduler) tells dependents that their dependencies finished.
The Lua side is lib.lua's flows section, link.lua, linked.lua and resolve.lua.
"""

from jobtier.flows.build import chain, fan_in

__all__ = ["chain", "fan_in"]
