"""Local services (Kafka-API broker, Redis), configuration and the `astec` CLI root."""
