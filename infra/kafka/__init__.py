"""The Apache Kafka broker option of `astec infra up` (jars from Maven via `make kafka`)."""
