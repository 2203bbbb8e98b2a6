# The broker alone: a slim Python, the package with its [server] extra, a non-root user.
#   docker build -t handoff-broker:0.1.0 .     (the name deploy/kubernetes/broker.yaml and docker-compose.yml use)
# The base is pinned to an exact release; pin it by digest too (python:3.11.7-slim-bookworm@sha256:...) where your
# registry policy asks for it.
FROM python:3.11.7-slim-bookworm

WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY client ./client
COPY server ./server
RUN pip install --no-cache-dir '.[server]' && rm -rf /src

RUN useradd --system --uid 10001 --no-create-home broker
USER broker
WORKDIR /home/broker

EXPOSE 50051 9464 50052
# The same gRPC health check Kubernetes probes use.
HEALTHCHECK --interval=10s --timeout=5s --start-period=5s --retries=3 \
    CMD ["handoff-broker", "health", "--target", "127.0.0.1:50051"]

ENTRYPOINT ["handoff-broker"]
CMD ["serve", "--host", "0.0.0.0", "--port", "50051", "--lane-port", "50052"]
