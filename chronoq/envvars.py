"""Every `CHRONOQ_*` environment variable that is not a broker setting, in one place.

Theory of operation: `chronoq serve` reads `CHRONOQ_<SETTING>` for each field of `Config`
(`chronoq/config.py`) and refuses to start on any other `CHRONOQ_*` name, naming the nearest
known one, so that a misspelled setting (`CHRONOQ_TIMER_MAX_DELAY_MS` without its `_MS`) is
never ignored without a word. The names here belong to the
broker's neighbours, which share its environment (a shell that exports `CHRONOQ_SERVER` for the
CLI and starts the broker too; a test run whose `chronoq serve` children inherit the runner's
variables): the broker lets them pass and does not read them. Whatever reads a `CHRONOQ_*`
variable that is not a setting declares its name here and reads it through the constant;
`tests/broker/test_config.py` checks that every `CHRONOQ_*` name in the repository is a setting
or one of these.
"""

from __future__ import annotations

PREFIX = "CHRONOQ_"

# -- the SDK (chronoq/client/aio.py) and the CLI (chronoq/cli/common.py) -------------------------
SERVER = "CHRONOQ_SERVER"
"""host:port of the server a client connects to (default 127.0.0.1:8081)."""
ACCESS_KEY = "CHRONOQ_ACCESS_KEY"
SECRET_KEY = "CHRONOQ_SECRET_KEY"
"""A client's credentials (RocketMQ ACL 2.0 signed headers), when auth is on."""

# -- the CLI only ---------------------------------------------------------------------------------
TLS = "CHRONOQ_TLS"
CA_CERT = "CHRONOQ_CA_CERT"
TLS_SERVER_NAME = "CHRONOQ_TLS_SERVER_NAME"
"""The CLI's --tls, --ca-cert and --tls-server-name defaults (the SDK takes arguments)."""

# -- the test suite --------------------------------------------------------------------------------
SCREENSHOT_DIR = "CHRONOQ_SCREENSHOT_DIR"
"""tests/e2e/test_console_browser.py: also save the console's screenshots there."""
PROP_EXAMPLES = "CHRONOQ_PROP_EXAMPLES"
"""tests/timer/test_timer_properties.py: hypothesis examples per property."""
TEST_TIMER_ENGINE = "CHRONOQ_TEST_TIMER_ENGINE"
"""tests/support/brokers.py: the timer engine a test's child process gives its brokers (a test that
runs on several engines sets it for the child it starts)."""

NOT_SETTINGS: frozenset[str] = frozenset({SERVER, ACCESS_KEY, SECRET_KEY, TLS, CA_CERT, TLS_SERVER_NAME,
                                          SCREENSHOT_DIR, PROP_EXAMPLES, TEST_TIMER_ENGINE})
"""The `CHRONOQ_*` names a broker lets pass without reading them."""
