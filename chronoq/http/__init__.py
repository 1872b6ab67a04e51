"""chronoq's HTTP side: Prometheus metrics (`metrics.py`), health, and the web console
(`server.py`, `console.py`, `static/`). Started by `chronoq serve --http-port PORT`."""
