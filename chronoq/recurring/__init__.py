"""Recurring schedules: named, durable objects that produce a timer message at each occurrence.

`spec.py` is the pure part (expressions, time zones, occurrences, jitter); `records.py` the
records that keep schedules in the commit log; `service.py` the broker's room (the live table,
issuing occurrences as timers, catch-up, pause, resume, update, delete, retention's roll).
"""
