"""chronoq's modules import one another without a circle.

A circle (A imports B imports A, however long the way round) means two modules are one
concept split in two, or one reaches up into a layer that builds it; and an import placed
inside a function to dodge the circle hides it from a reader. The graph is built by grimp (the
library import-linter is built on), which sees every import: at module level, inside functions,
and under `TYPE_CHECKING`.
"""

from __future__ import annotations

import grimp


def _circles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """Each import that closes a circle, as the circle: module A imports B, and B reaches A
    again by some chain of imports (grimp's shortest), so A, B, ..., back to A."""
    found = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                found.append((importer, *back))
    return found


def test_no_import_circles_in_chronoq() -> None:
    graph = grimp.build_graph("chronoq", cache_dir=None)
    circles = _circles(graph)
    assert not circles, "modules importing one another in a circle:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_circle() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    graph.add_import(importer="pkg.c", imported="pkg.d")
    assert _circles(graph) == [("pkg.a", "pkg.b", "pkg.c", "pkg.a"), ("pkg.b", "pkg.c", "pkg.a", "pkg.b"),
                              ("pkg.c", "pkg.a", "pkg.b", "pkg.c")]
