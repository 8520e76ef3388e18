# syntax=docker/dockerfile:1
# The relay's container image: wheels are built in one stage, installed into a virtualenv
# in a slim runtime that has no compiler, no build backend and no source tree.
#
#   docker build -t relay:0.1.0 .
#   docker run --rm -e RELAY_DATABASE_URL=... -e RELAY_KAFKA_BOOTSTRAP_SERVERS=... relay:0.1.0
#
# Dependencies come from requirements.lock (exact versions and PyPI hashes; regenerate
# with deploy/lock.sh). tests/test_deploy.py runs these same install steps outside Docker.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: the relay wheel plus every dependency as a wheel -------------------------
FROM ${PYTHON_IMAGE} AS build
# PIP_CERT: the system CA store (a network that inspects TLS adds its CA there), not
# the certifi bundle pip carries.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
WORKDIR /src
COPY requirements.lock requirements-build.lock ./
# The build tools go into their own virtualenv: a Debian base's system Python is
# externally managed (PEP 668), and nothing of them reaches the runtime stage.
# Binary wheels only: nothing is compiled, so no compiler is needed here either.
RUN python -m venv /build \
    && /build/bin/pip install --require-hashes --only-binary=:all: -r requirements-build.lock \
    && /build/bin/pip download --require-hashes --only-binary=:all: --no-deps \
       --dest /wheels -r requirements.lock
COPY pyproject.toml README.md ./
COPY relay ./relay
COPY migrations ./migrations
# The pinned hatchling from requirements-build.lock builds it (no isolated build env
# fetching an unpinned backend). migrations/ ends up inside it as relay/migrations.
RUN /build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

# --- runtime ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG RELAY_UID=10001
LABEL org.opencontainers.image.title="relay" \
      org.opencontainers.image.description="Transactional outbox relay: PostgreSQL outbox to Kafka, HTTP, NATS JetStream or RabbitMQ" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed, unprivileged UID/GID: Kubernetes' runAsUser/runAsNonRoot and file ownership
# of mounted secrets refer to it by number.
RUN groupadd --system --gid "${RELAY_UID}" relay \
    && useradd --system --uid "${RELAY_UID}" --gid relay --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin relay
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
# The wheels and the lock file are bind-mounted, not copied: neither becomes a layer of
# this image. Hashes are checked again here; `pip check` fails the build if the lock
# misses a dependency the relay declares. Then pip itself goes: nothing installs
# anything at run time.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,source=requirements.lock,target=/tmp/requirements.lock \
    python -m venv /opt/relay \
    && /opt/relay/bin/pip install --no-index --find-links /wheels --require-hashes \
       -r /tmp/requirements.lock \
    && /opt/relay/bin/pip install --no-index --no-deps /wheels/pg_outbox_relay-*.whl \
    && /opt/relay/bin/pip check \
    && /opt/relay/bin/python -m pip uninstall --yes --quiet pip setuptools
ENV PATH=/opt/relay/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    RELAY_METRICS_HOST=0.0.0.0 \
    RELAY_METRICS_PORT=9108 \
    RELAY_LOG_FORMAT=json
USER ${RELAY_UID}:${RELAY_UID}
WORKDIR /tmp
EXPOSE 9108
# For `docker run` and compose; Kubernetes ignores HEALTHCHECK and uses the Deployment's
# probes on the same endpoints (/healthz liveness, /readyz readiness).
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["relay", "healthcheck", "--timeout", "2"]
# The relay handles SIGTERM itself (stop taking batches, flush, release the lease); it
# starts no child processes, so running as PID 1 without an init is fine.
STOPSIGNAL SIGTERM
ENTRYPOINT ["relay"]
CMD ["run"]
