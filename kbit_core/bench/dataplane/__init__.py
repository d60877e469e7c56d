"""The data-plane benchmark: kbit's readers and loaders timed on one machine, beside peer readers of the same
topics (Ray Data, Spark's Kafka source, Apache Kafka's own tools)."""
