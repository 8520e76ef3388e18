"""Wiring for `relay run`: settings in, threads and servers up, clean shutdown out."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType

from relay import __version__
from relay.daemon import runtime
from relay.daemon.configs import lag_config, listener_config, presence_config, purge_config
from relay.daemon.lanes import FairShare, Lane
from relay.lease.protocol import Lease, Shard
from relay.observe import metrics, tracing
from relay.observe.lag import LagSampler
from relay.observe.logging import get_logger
from relay.observe.metrics import Health
from relay.observe.server import MetricsServer
from relay.settings import Settings, SettingsError
from relay.shutdown import Shutdown
from relay.sinks import Sink, create_sink
from relay.sinks.kafka.settings import plaintext_sasl_warnings
from relay.store import db, startup_checks
from relay.store.presence import Presence
from relay.store.purge import Purger
from relay.store.wakeup import Listener, Wakeup

log = get_logger("relay.app")


class RelayApp:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.shutdown = Shutdown(settings.shutdown_timeout_seconds)
        self.health = Health()
        # The elector and the sampler beat once per turn; one turn may wait out a
        # connect and a statement timeout against a sick database.
        db_wait = (
            settings.database_connect_timeout_seconds
            + 2 * settings.database_statement_timeout_seconds
        )
        shards = [Shard(settings.lease_name, n, settings.shards) for n in range(settings.shards)]
        # Before the sinks and loops, which take it at birth.
        self.tracing = tracing.configure(settings)
        metrics.TOPIC_LABELS.reset(settings.metrics_topic_labels)
        # One sink per shard: giving way, a deadline cut or a hand-over resets one
        # shard's producer, never another's in-flight messages.
        sinks = [create_sink(settings, self.tracing) for _ in shards]
        self.lanes: list[Lane] = []
        self.presence = Presence(
            presence_config(settings),
            self._connect,
            leading=lambda: any(lane.held() for lane in self.lanes),
            sink=sinks[0],
            stalled_for=self._worst_stall,
        )
        self.fair: FairShare | None = None
        if settings.shards > 1:
            # Peers that reach the sink: one that cannot defers and takes no shard, so
            # counting it would leave a shard it gave way on without a taker.
            self.fair = FairShare(settings.shards, self.presence.able_peers, self.held_shards)
        self._crashed: BaseException | None = None
        listening = listener_config(settings)
        wakeups = [Wakeup() for _ in shards] if listening is not None else []
        self.listener: Listener | None = None
        if listening is not None:
            self.listener = Listener(listening, self._connect, wakeups, self.shutdown)
        for index, (shard, sink) in enumerate(zip(shards, sinks, strict=True)):
            self._add_lane(shard, sink, wakeups[index] if wakeups else None, db_wait)
        self.health.db_ok = self._db_recently_ok
        self.lag_sampler: LagSampler | None = None
        if settings.lag_sample_seconds > 0:
            self.health.register("lag", max(60.0, 3 * settings.lag_sample_seconds + db_wait))
            self.lag_sampler = LagSampler(lag_config(settings), self._connect, self.health)
        # Retention: one purger for the whole outbox, run by whoever holds shard 0.
        self.purger: Purger | None = None
        if settings.keep_sent_rows:
            self.purger = Purger(purge_config(settings), self._connect, self.lanes[0].lease)
        self.metrics_server: MetricsServer | None = None

    def _add_lane(self, shard: Shard, sink: Sink, wakeup: Wakeup | None, db_wait: float) -> None:
        lane = Lane(
            self.settings,
            shard,
            sink,
            self.shutdown,
            self.health,
            self.fair,
            self.presence,
            self._lane_crashed,
            wakeup=wakeup,
            tracing=self.tracing,
        )
        self.lanes.append(lane)
        self.health.register(
            lane.elector.loop, max(60.0, 3 * self.settings.standby_poll_seconds + db_wait)
        )
        # The drain loop beats at least every poll; a publish waiting on a dead broker
        # beats from its wait loop too. Minutes of silence: truly stuck.
        self.health.register(lane.main_loop, max(60.0, 2 * sink.max_publish_seconds))

    def _connect(self, purpose: str) -> db.Conn:
        """Opens the sessions of presence, the sampler, the purger and the listener: each
        names its purpose, which becomes its application_name (relay:<purpose>)."""
        return db.connect(self.settings, purpose=purpose)

    @property
    def lease(self) -> Lease:
        """Shard 0's lease: with one shard, the lease."""
        return self.lanes[0].lease

    @property
    def sink(self) -> Sink:
        """Shard 0's sink: with one shard, the sink."""
        return self.lanes[0].sink

    def held_shards(self) -> list[int]:
        return [lane.shard.shard for lane in self.lanes if lane.held()]

    def _worst_stall(self) -> float:
        return max((lane.progress.stalled_for() for lane in self.lanes if lane.held()), default=0.0)

    def _lane_crashed(self, exc: BaseException) -> None:
        if self._crashed is None:
            self._crashed = exc
        self.shutdown.request("crash")

    def _db_recently_ok(self) -> bool:
        """A lease statement (an elector's, or a settle's renewal) came back within
        max(3 x standby poll, ttl): measured from the last real round trip, so a leader
        whose database is gone turns unready within that window. A standby that defers
        to a peer makes no lease round trips: its heartbeats count for it."""
        window = max(3 * self.settings.standby_poll_seconds, self.settings.lease_ttl_seconds)
        last_ok = max(lane.elector.last_db_ok for lane in self.lanes)
        if all(lane.lease.held_token() is None for lane in self.lanes):
            last_ok = max(last_ok, self.presence.last_db_ok)
        since = min(
            time.monotonic() - last_ok, *(lane.lease.since_renewal() for lane in self.lanes)
        )
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
        for variable, problem in startup_warnings(s):
            log.warning("settings.insecure", setting=variable, problem=problem)
        startup_checks.run(s)
        metrics.BUILD_INFO.info({"version": __version__, "sink": s.sink})
        if self.fair is not None:
            fair = self.fair
            metrics.SHARDS_HELD.labels(s.lease_name, "held").set_function(
                lambda: len(self.held_shards())
            )
            metrics.SHARDS_HELD.labels(s.lease_name, "fair_share").set_function(fair.cap)
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
            shards=s.shards,
            sink=s.sink,
            batch_size=s.batch_size,
            ttl=s.lease_ttl_seconds,
            metrics=f"{s.metrics_host}:{self.metrics_server.port}" if self.metrics_server else None,
        )
        for lane in self.lanes:
            lane.start()
        for loop in (self.presence, self.lag_sampler, self.purger, self.listener):
            if loop is not None:
                loop.start()
        try:
            while not self.shutdown.wait(0.25):
                pass
            for lane in self.lanes:
                lane.join(timeout=max(5.0, s.shutdown_timeout_seconds))
            if self._crashed is not None:
                # A bug, not an outage (those are retried where they happen): say so in
                # one structured line, give the leases up, and let the orchestrator
                # restart us.
                crash = self._crashed
                log.error(
                    "relay.crashed",
                    replica=s.replica_id,
                    exc_info=(type(crash), crash, crash.__traceback__),
                )
                return 1
        finally:
            self._stop()
        return 0

    def _stop(self) -> None:
        # Order matters: no new batches, then flush the sinks, then give the leases up
        # so standbys take over at their next poll instead of after a whole ttl.
        log.info("relay.stopping", reason=self.shutdown.reason or "error")
        flush = min(5.0, self.settings.shutdown_timeout_seconds)
        for lane in self.lanes:
            lane.stop(flush)
        for loop in (self.presence, self.lag_sampler, self.purger):
            if loop is not None:
                loop.stop()
                loop.join(timeout=5.0)
        if self.listener is not None:
            self.listener.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        tracing.shutdown()  # export the last spans
        log.info("relay.stopped", replica=self.settings.replica_id)


def startup_warnings(settings: Settings) -> list[tuple[str, str]]:
    """(variable, why) for each setting that works but lets credentials be read in
    transit: refusing them would stop deployments that run today."""
    found: list[tuple[str, str]] = []
    found += db.unverified_passwords(settings, os.environ)
    if settings.sink == "kafka":
        found += plaintext_sasl_warnings(settings)
    return found


def run(settings: Settings) -> int:
    app = RelayApp(settings)
    if threading.current_thread() is threading.main_thread():  # the process is ours
        app.install_signal_handlers()
        runtime.tune_garbage_collector()
    return app.run()
