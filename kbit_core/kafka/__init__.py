"""Kafka clients: connection settings, topic admin, producer and consumer backends, manifests and their registry."""
