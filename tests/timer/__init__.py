"""Timers and delay levels: the index, firing, links, retention and their faults."""
