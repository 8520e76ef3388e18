"""What a RabbitMQ publish that got no confirm means for its row (the sink's outcomes,
relay/sinks/base.py), and the counter of such publishes by kind."""

from __future__ import annotations

import asyncio

import aiormq.exceptions
from prometheus_client import Counter

from relay.sinks.base import Outcome, Result

PUBLISH_ERRORS = Counter(
    "relay_rabbitmq_publish_errors_total",
    "RabbitMQ publishes without a confirm, by kind (unroutable, nacked, ...).",
    ["kind"],
)


def queue_is_absent(exc: BaseException) -> bool:
    """A NOT_FOUND answer to a passive declare says either that no such queue exists
    ("no queue 'q' in vhost '/'") or that it exists and is not running: its process
    "is stopped by supervisor", "has crashed", its home node "is down or inaccessible",
    or the check timed out. A node just restarted after a crash answers the second way
    for a while, recovering its queues; only the first is the message's fault."""
    return str(exc).startswith("NOT_FOUND - no queue ")


def classify(exc: BaseException, exchange: str) -> Result:
    """A publish that got no confirm."""
    if isinstance(exc, aiormq.exceptions.PublishError):  # Basic.Return
        PUBLISH_ERRORS.labels("unroutable").inc()
        frame = getattr(exc, "frame", None)
        text = getattr(frame, "reply_text", "") or "returned"
        where = f"exchange {exchange!r}" if exchange else "the default exchange"
        return Result(
            Outcome.DEAD,
            f"unroutable ({text}): no queue is bound for this routing key on {where}",
            reached=True,
        )
    if isinstance(exc, aiormq.exceptions.DeliveryError):  # Basic.Nack
        PUBLISH_ERRORS.labels("nacked").inc()
        return Result(Outcome.RETRY, "the broker refused it (nack)", reached=True)
    if isinstance(exc, aiormq.exceptions.ChannelNotFoundEntity):
        PUBLISH_ERRORS.labels("no_exchange").inc()
        return Result(Outcome.UNAVAILABLE, f"exchange missing: {exc}", reached=True)
    if isinstance(exc, aiormq.exceptions.ChannelAccessRefused):
        PUBLISH_ERRORS.labels("access_refused").inc()
        return Result(Outcome.UNAVAILABLE, f"access refused: {exc}", reached=True)
    if isinstance(exc, aiormq.exceptions.ChannelPreconditionFailed) and "size" in str(exc):
        PUBLISH_ERRORS.labels("too_large").inc()
        return Result(Outcome.DEAD, f"the broker refused it: {exc}", reached=True)
    if isinstance(exc, asyncio.TimeoutError):
        PUBLISH_ERRORS.labels("timeout").inc()
        return Result(Outcome.UNAVAILABLE, "no confirm in time")
    PUBLISH_ERRORS.labels("connection").inc()
    return Result(Outcome.UNAVAILABLE, f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc))
