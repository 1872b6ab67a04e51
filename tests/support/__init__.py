"""Test support: what several test files share, imported as `tests.support.<module>`.

- `brokers`: `open_broker`, the one function that opens a test's `Broker`; simulated brokers
  (a `FakeClock`, no background tasks) and `SimulatedBrokers` behind the `brokers` fixture;
  `small_config`, `arun`.
- `invariants`: the consume queues checked against the raw commit log.
- `timers`: the broker-level timer tests' helpers (drain, fired copies, index snapshots).
- `clocks`: a simulated machine's wall and monotonic clocks, for `SystemClock` under steps.
- `disks`: a real small tmpfs and a filler file, for the full-disk faults.
- `grpc_server`: an in-process gRPC server over a real broker, and request builders.
- `auth_server`: the same with authentication, and the users the auth tests share.
- `protocol_strategies`: Hypothesis strategies for arbitrary RocketMQ v2 messages.
- `extras`: skip a test whose optional part is missing (fail under `CI=true`).

A real `chronoq serve` child process is `chronoq.client.testing.ServerProcess`, and a free port
`chronoq.client.testing.free_port`: the product's own, used by tests, benchmarks and demos alike.
Fixtures built on these live in tests/conftest.py.
"""
