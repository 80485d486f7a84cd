"""NNX graphdefs as `jax.jit` static arguments, hashed once.

Contract: `static_graph(graphdef) -> StaticGraph`, a wrapper to pass where a jitted function takes a graphdef
as a static argument; the function reads `.graphdef`. jit hashes its static arguments on every call, and an NNX
graphdef hashes by walking its whole structure (host time on every layer of every decode step; a third of the
offload engine's host time on a tiny model). The wrapper hashes once. Equal graphdefs map to one wrapper object
(interned), so jit's cache compares them by identity and every layer of one kind shares its compiled programs.
"""

from __future__ import annotations

from typing import Any

_interned: dict[Any, "StaticGraph"] = {}


class StaticGraph:
    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, StaticGraph) and self.graphdef == other.graphdef)


def static_graph(graphdef) -> StaticGraph:
    """The one wrapper of graphdefs equal to `graphdef`."""
    return _interned.setdefault(graphdef, StaticGraph(graphdef))
