"""`relay console`: settings, then uvicorn serving the console until SIGTERM/SIGINT."""

from __future__ import annotations

from relay.console.app import create_app
from relay.console.settings import load_all
from relay.observe.logging import configure, get_logger

log = get_logger("relay.console")


def serve() -> int:
    """Raises SettingsError (exit 2 in relay/admin/cli.py) before anything listens."""
    import uvicorn

    common, settings = load_all()
    configure(common.log_format, common.log_level)
    app = create_app(common, settings)
    log.info(
        "console.start",
        host=settings.host,
        port=settings.port,
        read_only=settings.read_only,
        proxy_header=settings.trusted_user_header,
        allowed_hosts=str(settings.hosts),
        statement_timeout_seconds=settings.statement_timeout_seconds,
    )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,  # the client address is the peer's: the proxy check needs it
        server_header=False,
        timeout_graceful_shutdown=5,
    )
    return 0
