"""chronoq: a durable message broker whose headline job is scheduled and delayed messages."""

__version__ = "0.1.0"
