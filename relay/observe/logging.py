"""structlog set-up: JSON lines in production, key=value on a terminal."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogFormat = Literal["json", "console"]


def configure(log_format: LogFormat | None = None, level: str = "info") -> None:
    fmt: LogFormat = log_format or ("console" if sys.stderr.isatty() else "json")
    renderer: structlog.types.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(name)
    return logger


class _ToStructlog(logging.Handler):
    """Forwards a library's stdlib log records into our structured stream."""

    def __init__(self, event: str) -> None:
        super().__init__()
        self._event = event

    def emit(self, record: logging.LogRecord) -> None:
        level = record.levelname.lower()
        log = get_logger(record.name)
        method = getattr(log, level if level in {"debug", "info", "warning", "error"} else "info")
        method(self._event, message=record.getMessage())


def library_logger(name: str, event: str) -> logging.Logger:
    """A stdlib logger (what librdkafka's `logger` setting wants) that writes as structlog,
    so JSON log pipelines do not choke on a client library's raw lines."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        logger.addHandler(_ToStructlog(event))
        logger.propagate = False
        logger.setLevel(logging.INFO)
    return logger


class OutageLog:
    """One warning when a periodic job starts failing and one line when it recovers,
    instead of a line per attempt for as long as the outage lasts."""

    def __init__(self, log: structlog.stdlib.BoundLogger, failed: str, recovered: str) -> None:
        self._log = log
        self._failed = failed
        self._recovered = recovered
        self.failing = False

    def failure(self, error: str) -> None:
        if not self.failing:
            self._log.warning(self._failed, error=error)
        self.failing = True

    def success(self) -> None:
        if self.failing:
            self._log.info(self._recovered)
        self.failing = False
