# syntax=docker/dockerfile:1
# One image recipe for Abada's three services, chosen with SERVICE (a directory under services/):
#   docker build --build-arg SERVICE=engine -t abada/engine:TAG .
#   docker build --build-arg SERVICE=credential-broker -t abada/credential-broker:TAG .
#   docker build --build-arg SERVICE=agent-worker -t abada/agent-worker:TAG .
# Build from the repository root (`make images` builds all three).

ARG PYTHON_IMAGE=python:3.11-slim
ARG SERVICE=engine

# Stage 1: generate the gRPC stubs from proto/ and build every wheel the service needs.
FROM ${PYTHON_IMAGE} AS build
ARG SERVICE
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
# Same generator version as requirements-dev.txt, so the image's stubs match the repository's.
RUN pip install grpcio-tools==1.85.1
COPY proto/ proto/
COPY scripts/gen_protos.py scripts/gen_protos.py
COPY api/python/pyproject.toml api/python/pyproject.toml
RUN python scripts/gen_protos.py
COPY services/common/ services/common/
COPY sdk/python/ sdk/python/
COPY services/${SERVICE}/ services/${SERVICE}/
# The local projects in one resolve: the service's "abada-api" and "abada-sdk" requirements are met
# by ./api/python and ./sdk/python.
RUN pip wheel --wheel-dir /wheels ./api/python ./services/common ./sdk/python ./services/${SERVICE}

# Stage 2: only the installed wheels, run as an unprivileged user. Each service's project is
# named abada-SERVICE.
FROM ${PYTHON_IMAGE} AS runtime
ARG SERVICE
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN groupadd --system --gid 10001 abada \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin abada
# Offline install from the build stage's wheels only; pip compiles the bytecode now, because the
# root filesystem is read-only at run time.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels abada-${SERVICE}
USER 10001:10001
WORKDIR /tmp

# Stage 3: what each service's image says about itself. ENTRYPOINT takes no build argument, so each
# has its own few lines; the last FROM picks SERVICE's (BuildKit builds only that one).
FROM runtime AS service-engine
LABEL org.opencontainers.image.title="abada-engine" \
      org.opencontainers.image.description="Abada engine: definitions, instances, leased external tasks, the step journal."
EXPOSE 50051 8080
ENTRYPOINT ["abada-engine"]
CMD ["serve"]

FROM runtime AS service-credential-broker
LABEL org.opencontainers.image.title="abada-credential-broker" \
      org.opencontainers.image.description="Abada credential broker: tool-server secrets from Vault, only for the live lease holder."
EXPOSE 50061 50062 9090
ENTRYPOINT ["abada-broker"]

FROM runtime AS service-agent-worker
LABEL org.opencontainers.image.title="abada-agent-worker" \
      org.opencontainers.image.description="Abada agent worker: the durable LLM loop with MCP tools."
EXPOSE 8081
ENTRYPOINT ["abada-worker"]

FROM service-${SERVICE}
