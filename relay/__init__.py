"""relay: a transactional outbox relay for PostgreSQL, publishing to Kafka."""

from __future__ import annotations

__version__ = "0.1.0"
