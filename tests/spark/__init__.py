"""The PySpark side: the data source, the timer engine, scheduling from files and the trace report."""
