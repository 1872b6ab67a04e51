"""chronoq's SDK and command line against real servers: the async and sync clients, retries, the CLI."""
