"""chronoq's data pipeline on Apache Spark (PySpark 4.3, Java 17); see docs/spark.md.

Theory of operation: `datasource` (the `chronoq` format: read a topic, write messages),
`schedule` (a table in, timer messages or rejects out), `report` over a `trace`, and the timer
engine (`engine` wiring, `timer_processor` state logic). Importing this package does not import
pyspark; `trace` needs only pyarrow, so the broker can write a trace without Spark.
"""
