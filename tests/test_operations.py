"""What an operator sees: /metrics, /healthz, /readyz, `relay status`, `relay check`."""

from __future__ import annotations

import json
import subprocess
import urllib.request

from tests.conftest import SettingsFactory, relay_command, relay_env
from tests.harness import free_port
from tests.harness.kafka import TansuBroker
from tests.support import insert_rows, keyed_rows, running_relay, scalar, wait_until


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback only
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except urllib.error.URLError:
        return 0, ""  # not listening yet


def test_metrics_and_probes_report_the_leader_and_its_work(
    make_settings: SettingsFactory, database: str, topic: str
) -> None:
    port = free_port()
    settings = make_settings(metrics_enabled=True, metrics_port=port, lease_name="metrics")
    base = f"http://127.0.0.1:{port}"
    with running_relay(settings):
        wait_until(
            lambda: 'relay_lease_held{lease="metrics"} 1.0' in get(f"{base}/metrics")[1], timeout=10
        )
        insert_rows(database, topic, keyed_rows(keys=2, per_key=5))
        wait_until(lambda: scalar(database, "SELECT count(*) FROM outbox") == 0, timeout=20)
        status, body = get(f"{base}/metrics")
        assert status == 200
        assert f'relay_messages_total{{outcome="acked",sink="kafka",topic="{topic}"}} 10.0' in body
        assert "relay_end_to_end_latency_seconds_count" in body
        assert get(f"{base}/healthz")[0] == 200
        assert get(f"{base}/readyz")[0] == 200
        assert get(f"{base}/nope")[0] == 404


def test_status_shows_the_holder_and_check_fails_clearly_without_a_password_leak(
    make_settings: SettingsFactory, relay_dsn: str, kafka: TansuBroker
) -> None:
    with running_relay(make_settings(replica_id="replica-under-test")):
        wait_until(
            lambda: scalar(relay_dsn, "SELECT holder FROM leases WHERE expires_at > now()"),
            timeout=10,
        )
        env = relay_env(relay_dsn, kafka.bootstrap_servers)
        done = subprocess.run(
            relay_command("status", "--json"), env=env, capture_output=True, timeout=60, check=True
        )
        status = json.loads(done.stdout)
        assert status["leases"][0]["holder"] == "replica-under-test"
        assert status["leases"][0]["live"] is True
        assert status["schema_version"] == "0001"

        ok = subprocess.run(
            relay_command("check"), env=env, capture_output=True, timeout=60, check=False
        )
        assert ok.returncode == 0, ok.stderr
        assert b"database: ok" in ok.stdout and b"kafka: ok" in ok.stdout

    bad_url = relay_dsn.replace(":relay-secret-pw@", ":wrong-pw-123@")
    env["RELAY_DATABASE_URL"] = bad_url
    bad = subprocess.run(
        relay_command("check"), env=env, capture_output=True, timeout=60, check=False
    )
    assert bad.returncode == 1
    assert b"database: FAILED" in bad.stderr and b"password authentication failed" in bad.stderr
    assert b"wrong-pw-123" not in bad.stdout + bad.stderr


def test_check_fails_clearly_on_a_dead_broker(relay_dsn: str) -> None:
    env = relay_env(relay_dsn, f"127.0.0.1:{free_port()}")
    done = subprocess.run(
        relay_command("check"), env=env, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert b"database: ok" in done.stdout
    assert b"sink: FAILED" in done.stderr
    assert b"relay-secret-pw" not in done.stdout + done.stderr
