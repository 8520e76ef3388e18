"""A real Prometheus server (Debian's `prometheus` package) scraping targets on loopback,
queried through its HTTP API: the metrics are checked the way an alert would read them."""

from __future__ import annotations

import atexit
import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.harness import Service, free_port


def find_prometheus() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise RuntimeError("prometheus not found: `./dev test` installs it (Debian package)")
    return found


class PrometheusServer(Service):
    """Scrapes `targets` (host:port) every `scrape_interval`, with its own temp storage."""

    def __init__(self, targets: Sequence[str], scrape_interval: str = "1s") -> None:
        self.targets = list(targets)
        self.scrape_interval = scrape_interval
        self.port = free_port()
        self.base_dir = Path(tempfile.mkdtemp(prefix="relay-prom-"))
        self.log_path = self.base_dir / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        # JSON is valid YAML: no YAML library needed to write the config.
        config = {
            "global": {
                "scrape_interval": self.scrape_interval,
                "scrape_timeout": self.scrape_interval,
                "evaluation_interval": self.scrape_interval,
            },
            "scrape_configs": [
                {"job_name": "relay", "static_configs": [{"targets": self.targets}]}
            ],
        }
        path = self.base_dir / "prometheus.yml"
        path.write_text(json.dumps(config, indent=2))
        return path

    def start(self) -> None:
        cmd = [
            find_prometheus(),
            f"--config.file={self._write_config()}",
            f"--storage.tsdb.path={self.base_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self._ready():
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not become ready:\n{self.log_tail()}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:  # noqa: S310
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError):
            return False

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.base_dir / "data", ignore_errors=True)

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=5) as response:  # noqa: S310
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus API error: {body}")
        return body["data"]

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant query: (labels, value) per series of the result vector."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return [(item["metric"], float(item["value"][1])) for item in data["result"]]

    def targets_up(self) -> int:
        active = self.api("targets", state="active")["activeTargets"]
        return sum(1 for target in active if target["health"] == "up")

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
