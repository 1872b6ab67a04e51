"""The benchmark harness: processes, workload, phases, report (see bench/__init__.py)."""
