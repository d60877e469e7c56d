"""Kafka access: the embedded broker, client backends, topic admin, producing and reading."""
