"""`chronoq check`'s report as a person reads it: counts in words that agree with them."""

from __future__ import annotations

from chronoq.store.check import CheckReport, format_report


def test_one_of_each_is_singular() -> None:
    text = format_report(CheckReport(segments=1, records=1, queues=1, cq_entries=1, log_end=120), "d")
    assert "commit log: 1 segment, 1 record, positions [0, 120)" in text
    assert "consume queues: 1 queue, 1 entry" in text
    assert text.endswith("  OK")


def test_many_are_plural_with_thousands_marked() -> None:
    text = format_report(CheckReport(segments=3, records=12_345, queues=0, cq_entries=12_345), "d")
    assert "commit log: 3 segments, 12,345 records" in text
    assert "consume queues: 0 queues, 12,345 entries" in text


def test_verdict_lines_count_what_they_found() -> None:
    assert "DAMAGED: 1 problem, 2 repairs" in format_report(CheckReport(problems=["p"], repairs=["a", "b"]), "d")
    assert "REPAIRABLE: 1 finding a restart repairs" in format_report(CheckReport(repairs=["torn tail"]), "d")
