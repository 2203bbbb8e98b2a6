# The broker alone: a slim Python, the package with its [server] extra, a non-root user.
FROM python:3.11-slim

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
