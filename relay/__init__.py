"""relay: a transactional outbox relay for PostgreSQL, publishing to Kafka, HTTP, NATS
JetStream or RabbitMQ.

Apps write messages with `relay.enqueue(conn, topic, payload, key=None, headers=None)`
(or `relay.enqueue_async`) inside their own transaction; `relay run` publishes them.
`relay.cancel(conn, id)` takes back a row scheduled for later that is not yet due.
"""

from __future__ import annotations

__version__ = "0.1.0"

from relay.producer import Enqueued, cancel, cancel_async, enqueue, enqueue_async

__all__ = ["Enqueued", "__version__", "cancel", "cancel_async", "enqueue", "enqueue_async"]
