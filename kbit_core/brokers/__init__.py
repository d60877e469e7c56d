"""Broker lifecycles: the local brokers kbit starts and stops (Tansu, Apache Kafka, a multi-node cluster)."""
