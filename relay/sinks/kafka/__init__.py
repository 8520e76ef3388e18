"""The Kafka sink (confluent-kafka): idempotent producer, per-key partitions."""
