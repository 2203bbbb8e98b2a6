# The broker alone: a slim Python, the package with its [server] extra, a non-root user.
#   docker build -t handoff-broker:0.3.0.dev0 .     (the name deploy/kubernetes/base and docker-compose.yml use)
# The base is the current Python 3.11 patch release, pinned exactly; pin it by digest too
# (python:3.11.15-slim-bookworm@sha256:...) where your registry policy asks for it.
FROM python:3.11.15-slim-bookworm

# Every Python dependency comes from requirements/broker.lock, pinned with its sha256 hashes (pip refuses any file
# whose hash differs). It is generated, never edited by hand; after changing pyproject.toml's dependencies:
#   pip install pip-tools && pip-compile --extra server --generate-hashes --allow-unsafe --strip-extras \
#       --no-emit-index-url --no-emit-find-links -o requirements/broker.lock pyproject.toml requirements/build.in
WORKDIR /src
COPY requirements/broker.lock ./requirements/
RUN pip install --no-cache-dir --require-hashes --only-binary=:all: -r requirements/broker.lock
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY client ./client
COPY server ./server
# The package itself, against the locked dependencies only (no resolver, nothing fetched).
RUN pip install --no-cache-dir --no-deps --no-build-isolation . && rm -rf /src

RUN useradd --system --uid 10001 --no-create-home broker
USER 10001
WORKDIR /tmp

# The broker's ports are HANDOFF_PORT and HANDOFF_HEALTH_PORT (serve reads them, as it reads every flag from
# HANDOFF_*), so the HEALTHCHECK follows them: `docker run -e HANDOFF_HEALTH_PORT=6001 ...` serves health and is
# probed on 6001; HANDOFF_HEALTH_PORT=-1 serves none, and the HEALTHCHECK asks HANDOFF_PORT. Two brokers in one
# network namespace (`--network host`) each need their own HANDOFF_PORT and HANDOFF_HEALTH_PORT. The health port
# serves plaintext health statuses alone, with no thread per call (docs/security.md).
ENV HANDOFF_PORT=50051 \
    HANDOFF_HEALTH_PORT=50053 \
    PYTHONDONTWRITEBYTECODE=1
EXPOSE 50051 9464 50052 50053
# The same gRPC health check Kubernetes probes use, on the health port.
HEALTHCHECK --interval=10s --timeout=5s --start-period=5s --retries=3 \
    CMD ["sh", "-c", "exec handoff-broker health --target \"127.0.0.1:${HANDOFF_PORT}\" --health-port \"${HANDOFF_HEALTH_PORT}\""]

ENTRYPOINT ["handoff-broker"]
CMD ["serve", "--host", "0.0.0.0", "--lane-port", "50052"]
