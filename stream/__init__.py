"""Kafka workers, message schemas, the Redis state store, the click logger and live traffic."""
