"""The message store on disk: commit log, consume queues, recovery, checks, and its fault handling."""
