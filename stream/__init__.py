"""Kafka consumers/producers, message schemas, the Redis state store, click logging, simulator."""
