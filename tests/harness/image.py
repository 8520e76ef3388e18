"""The project's Dockerfile, built and run for real with podman (no Docker engine here).

The base image is made locally from Debian packages (debootstrap from the machine's own
apt mirror, with python3 and python3-venv), so no container registry is needed; it is
kept in podman's image store between runs and made again only when missing. Podman on
these machines needs runc (crun refuses hybrid cgroups), the cgroupfs manager and
default ulimits within the machine's hard limits: a containers.conf says so. pip inside
the build trusts the same CA bundle as the host, copied into the base.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import tempfile
from pathlib import Path

BASE = "localhost/relay-base:bookworm"
PACKAGES = "python3,python3-venv,python3-pip,python-is-python3,ca-certificates"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
DEFAULT_MIRROR = "http://deb.debian.org/debian"


def available() -> bool:
    return os.geteuid() == 0 and all(shutil.which(t) for t in ("podman", "debootstrap", "runc"))


def debian_mirror() -> str:
    """The mirror this machine's apt uses (deb822 or one-line sources), if it says."""
    for path in [*Path("/etc/apt/sources.list.d").glob("*.sources")]:
        if match := re.search(r"^URIs:\s*(\S+)", path.read_text(), re.MULTILINE):
            return match.group(1)
    one_line = Path("/etc/apt/sources.list")
    if one_line.exists():
        for line in one_line.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == "bookworm":
                return parts[1]
    return DEFAULT_MIRROR


class Podman:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1_048_576)
        nproc_limit = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        nproc = pid_max if nproc_limit == resource.RLIM_INFINITY else min(nproc_limit, pid_max)
        conf = workdir / "containers.conf"
        conf.write_text(
            "[containers]\n"
            f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
            "[engine]\n"
            'runtime = "runc"\n'
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n'
        )
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["podman", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: {done.returncode}\n{done.stderr}")
        return done

    def ensure_base(self) -> str:
        if self("image", "exists", BASE, check=False).returncode == 0:
            return BASE
        root = Path(tempfile.mkdtemp(prefix="relay-base-", dir=self.workdir))
        try:
            subprocess.run(
                ["debootstrap", "--variant=minbase", f"--include={PACKAGES}", "bookworm",
                 str(root), debian_mirror()],
                check=True, capture_output=True, timeout=900,
            )  # fmt: skip
            shutil.copy2(HOST_CA_BUNDLE, root / HOST_CA_BUNDLE.relative_to("/"))
            tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
            imported = subprocess.run(
                ["podman", "import", "-", BASE],
                stdin=tar.stdout, env=self.env, capture_output=True, timeout=300, check=False,
            )  # fmt: skip
            tar.wait(timeout=60)
            if imported.returncode != 0:
                raise AssertionError(f"podman import: {imported.stderr.decode()}")
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return BASE

    def build(self, context: Path, tag: str) -> None:
        # --no-cache: podman 4.3 can bind-mount a stale layer of a cached build stage
        # (RUN --mount from=build), which then lacks the relay's own wheel.
        self(
            "build", "--no-cache", "--format", "docker", "--network", "host",
            "--build-arg", f"PYTHON_IMAGE={self.ensure_base()}", "-t", tag, str(context),
            timeout=900,
        )  # fmt: skip
