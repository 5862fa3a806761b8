"""Local services (an Apache Kafka broker, redis-server), the `astec` CLI root and the demo."""
