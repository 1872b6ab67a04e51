"""Every error a client can see maps to one class with a documented RocketMQ code.

Walks every chronoq module, so an error class added anywhere later is checked too: it must be
defined in `chronoq/errors.py` (or `chronoq/protocol/errors.py`), carry a code of the RocketMQ v2
`Code` enum, come back as itself when the admin service names it, and, when only the code is
known (the RocketMQ protocol), come back as the one base class that `chronoq/errors.py`'s table
names for that code.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest
from rocketmq.grpc_protocol import definition_pb2

import chronoq
from chronoq import errors as core
from chronoq.client import errors as client_errors
from chronoq.client.errors import from_status


def _all_chronoq_modules() -> None:
    for info in pkgutil.walk_packages(chronoq.__path__, "chronoq."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:  # optional extras (pyspark, matplotlib) not installed here
            continue


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


_all_chronoq_modules()
VISIBLE = sorted((c for c in _subclasses(core.ChronoqError)
                  if c.__module__.startswith("chronoq.")
                  and not issubclass(c, (client_errors.ClientError, client_errors.RemoteError))),
                 key=lambda c: c.__name__)
TABLE = {int(m.group(1)): (m.group(2), m.group(3))
         for m in re.finditer(r"^    (\d{5}) (\w+)\s+(\w+)", core.__doc__ or "", re.M)}


def test_every_visible_error_class_is_found() -> None:
    names = {c.__name__ for c in VISIBLE}
    assert {"LogDamaged", "TimerIndexCorrupt", "TimerIndexClosed", "IndexPositionWentBack", "MissingField",
            "TopicNotFound", "DiskFull"} <= names


@pytest.mark.parametrize("cls", VISIBLE, ids=lambda c: c.__name__)
def test_each_class_maps_to_one_client_class_with_a_documented_code(cls: type[core.ChronoqError]) -> None:
    assert cls.__module__ in ("chronoq.errors", "chronoq.protocol.errors"), \
        f"{cls.__name__} is defined in {cls.__module__}: the SDK cannot map it by name"
    code = cls.code
    assert code in definition_pb2.Code.values(), f"{cls.__name__}.code = {code} is not a RocketMQ v2 Code"
    assert code in TABLE, f"code {code} of {cls.__name__} is missing from chronoq/errors.py's table"
    rocketmq_name, client_class = TABLE[code]
    assert rocketmq_name == definition_pb2.Code.Name(code)
    by_name = from_status(code, "the server's message", error=cls.__name__)
    assert type(by_name) is cls and by_name.code == code and by_name.retriable == cls.retriable
    by_code = from_status(code, "the server's message")
    assert type(by_code).__name__ == client_class, f"code {code}: the SDK raises {type(by_code).__name__}"
    assert isinstance(by_code, core.ChronoqError) and issubclass(cls, type(by_code))


def test_the_table_lists_only_codes_in_use() -> None:
    assert set(TABLE) == {c.code for c in VISIBLE}


@pytest.mark.parametrize(("code", "client_class"), [(40002, "InvalidTopicName"), (40007, "InvalidProperty"),
                                                    (40014, "MessageTypeMismatch"), (42800, "TimerNotPending")])
def test_codes_that_used_to_reach_a_rocketmq_client_as_bad_request(code: int, client_class: str) -> None:
    assert type(from_status(code, "m")).__name__ == client_class


def test_each_refusal_has_one_name_and_the_old_names_are_aliases_of_it() -> None:
    """40100 is `Unauthorized` and a permission refusal `Forbidden`, whichever call refused it; the
    names each cause once had are the same class (for `except` clauses), not classes of their own."""
    for old in ("MissingCredentials", "MalformedAuthorization", "UnknownAccessKey", "BadSecretKey", "BadSignature",
                "StaleSignature"):
        assert getattr(core, old) is core.Unauthorized, old
    assert core.PermissionDenied is core.Forbidden
    assert {c.__name__ for c in VISIBLE if c.code in (40100, 40300)} == {"Unauthorized", "Forbidden", "TimerDisabled"}
    # A server that still names an old class is understood as the one name.
    assert type(from_status(40100, "m", error="BadSignature")) is core.Unauthorized
    assert type(from_status(40300, "m", error="PermissionDenied")) is core.Forbidden
