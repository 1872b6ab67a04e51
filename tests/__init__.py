"""chronoq's tests, by layer: store, timer, broker, protocol, server, client, spark, e2e, interop.

A package (like each layer's directory) so every test module and the shared helpers in
`tests.support` import by their full name from the repository root, which pyproject's pytest
settings put on the path; no test edits `sys.path`.
"""
