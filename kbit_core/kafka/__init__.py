"""Kafka clients: the embedded broker, connection settings, topic admin, producer and consumer backends, manifests."""
