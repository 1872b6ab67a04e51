"""Side-by-side benchmark: chronoq against the delay queues people use today, in one run.

Theory of operation: `bench.harness` owns the workload, the server processes, the producer and
consumer worker processes, the phases (accept, precision, crash, backlog) and the report;
`bench.peers` holds one module per system, each knowing only how to check, start, feed and drain
its own server. The harness never imports chronoq's internals: chronoq is measured the way a user
runs it (`chronoq serve` plus the SDK), exactly like the peers, so the comparison is fair.
Run it with `python -m bench` (see `python -m bench --help`); results land in
`bench/results/<timestamp>/`.
"""
