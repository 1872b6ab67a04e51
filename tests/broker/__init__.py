"""The broker's own behaviour on a real store: sends, receives, acks, admission, clocks, limits."""
