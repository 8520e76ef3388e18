"""Wiring for `relay run`: settings in, threads and servers up, clean shutdown out."""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType

from relay import __version__, metrics
from relay.drain import Drainer
from relay.elector import Elector
from relay.guard import DeadlineGuard
from relay.lag import LagSampler
from relay.lease import Lease
from relay.logging import get_logger
from relay.metrics import Health, MetricsServer
from relay.presence import Presence, Progress
from relay.purge import Purger
from relay.settings import Settings, SettingsError
from relay.shutdown import Shutdown
from relay.sinks import create_sink

log = get_logger("relay.app")


class RelayApp:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.shutdown = Shutdown(settings.shutdown_timeout_seconds)
        self.lease = Lease(
            settings.lease_name,
            settings.replica_id,
            settings.lease_ttl_seconds,
            settings.safety_margin,
            time.monotonic,
        )
        self.health = Health()
        # The elector and the sampler beat once per turn; one turn may wait out a
        # connect and a statement timeout against a sick database.
        db_wait = (
            settings.database_connect_timeout_seconds
            + 2 * settings.database_statement_timeout_ms / 1000
        )
        self.health.register("elector", max(60.0, 3 * settings.standby_poll_seconds + db_wait))
        self.sink = create_sink(settings)
        # The main loop beats at least every poll; a publish waiting on a dead broker
        # beats from its wait loop too. Minutes of silence means it is truly stuck.
        self.health.register("main", max(60.0, 2 * self.sink.max_publish_seconds))
        progress = Progress()
        self.presence = Presence(settings, self.lease, self.sink, progress)
        self.elector = Elector(settings, self.lease, health=self.health, defer=self.presence.defer)
        self.health.db_ok = self._db_recently_ok
        self.lag_sampler: LagSampler | None = None
        if settings.lag_sample_seconds > 0:
            self.health.register("lag", max(60.0, 3 * settings.lag_sample_seconds + db_wait))
            self.lag_sampler = LagSampler(settings, self.health)
        self.purger = Purger(settings, self.lease) if settings.keep_sent_rows else None
        self.guard = DeadlineGuard(self.lease, self.sink)
        self.drainer = Drainer(
            settings,
            self.sink,
            self.lease,
            self.shutdown,
            self.health,
            presence=self.presence,
            progress=progress,
        )
        self.metrics_server: MetricsServer | None = None

    def _db_recently_ok(self) -> bool:
        """A lease statement (the elector's, or a settle's renewal) came back within
        max(3 x standby poll, ttl): measured from the last real round trip, so a leader
        whose database is gone turns unready within that window. A standby that defers
        to a peer makes no lease round trips: its heartbeats count for it."""
        window = max(3 * self.settings.standby_poll_seconds, self.settings.lease_ttl_seconds)
        last_ok = self.elector.last_db_ok
        if self.lease.held_token() is None:
            last_ok = max(last_ok, self.presence.last_db_ok)
        since = min(time.monotonic() - last_ok, self.lease.since_renewal())
        return since < window

    def install_signal_handlers(self) -> None:
        def on_signal(signum: int, _frame: FrameType | None) -> None:
            # Only set a flag: the handler runs on the main thread between two bytecodes,
            # possibly inside a log write whose (non-reentrant) lock it would then wait on.
            self.shutdown.request(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def run(self) -> int:
        s = self.settings
        metrics.BUILD_INFO.info({"version": __version__, "sink": s.sink})
        metrics.declare_lease(s.lease_name, lambda: self.lease.token() is not None)
        metrics.LEASE_SINCE_RENEWAL.labels(s.lease_name).set_function(self.lease.since_renewal)
        if s.metrics_enabled:
            try:
                self.metrics_server = MetricsServer(s.metrics_host, s.metrics_port, self.health)
            except OSError as exc:
                raise SettingsError(
                    "RELAY_METRICS_PORT",
                    f"cannot listen on {s.metrics_host}:{s.metrics_port} ({exc.strerror})",
                ) from None
            self.metrics_server.start()
        log.info(
            "relay.started",
            version=__version__,
            replica=s.replica_id,
            lease=s.lease_name,
            sink=s.sink,
            batch_size=s.batch_size,
            ttl=s.lease_ttl_seconds,
            metrics=f"{s.metrics_host}:{self.metrics_server.port}" if self.metrics_server else None,
        )
        self.elector.start()
        for loop in (self.presence, self.lag_sampler, self.purger, self.guard):
            if loop is not None:
                loop.start()
        try:
            while not self.shutdown.requested:
                self.health.beat()
                if self.lease.wait_held(timeout=0.25) is None:
                    # Standby keeps its producer warm for a fast takeover; serving its
                    # events keeps client logs and errors from piling up unread.
                    self.sink.flush(0)
                    continue
                self.drainer.drain()
        except Exception:
            # A bug, not an outage (those are retried where they happen): say so in one
            # structured line, give the lease up, and let the orchestrator restart us.
            log.exception("relay.crashed", replica=s.replica_id)
            return 1
        finally:
            self._stop()
        return 0

    def _stop(self) -> None:
        # Order matters: no new batches, then flush the sink, then give the lease up
        # so a standby takes over at its next poll instead of after a whole ttl.
        log.info("relay.stopping", reason=self.shutdown.reason or "error")
        try:
            left = self.sink.flush(min(5.0, self.settings.shutdown_timeout_seconds))
            if left:
                log.warning("sink.flush_incomplete", messages=left)
        except Exception as exc:  # a dead producer must not keep the lease held
            log.warning("sink.flush_failed", error=str(exc))
        # The drain loop has returned and waited for its last settle; closing it first
        # makes sure no settle (which renews the lease) runs after the release.
        self.drainer.close()
        self.elector.stop()
        self.elector.join(timeout=5.0)
        if self.elector.is_alive():
            # Still inside a database call: releasing on its connection would race it.
            # The lease then ends by its ttl instead.
            log.warning("lease.release_skipped", reason="elector busy")
        else:
            self.elector.release()
        for loop in (self.presence, self.lag_sampler, self.purger, self.guard):
            if loop is not None:
                loop.stop()
                loop.join(timeout=5.0)
        self.sink.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        log.info("relay.stopped", replica=self.settings.replica_id)


def run(settings: Settings) -> int:
    app = RelayApp(settings)
    if threading.current_thread() is threading.main_thread():
        app.install_signal_handlers()
    return app.run()
