# Tether's runtime image: the worker (default command), the codec server, the billing example
# and the client CLI all run from it. Only runtime dependencies: no dev extra, no tests, no
# Temporal dev-server binaries.
#
#   docker build -t tether:local .
#   docker run --rm -e TEMPORAL_ADDRESS=host:7233 tether:local
ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY worker.py starter.py ./
COPY workflows ./workflows
COPY activities ./activities
COPY tether ./tether
# A non-editable install into its own venv: the final stage copies only the venv. Runtime
# dependencies only (cryptography, for the codec and signed approvals, is one of them); set
# TETHER_EXTRAS=otel for tracing, or openai for the model planner.
ARG TETHER_EXTRAS=""
RUN python -m venv /opt/tether \
    && /opt/tether/bin/pip install ".${TETHER_EXTRAS:+[$TETHER_EXTRAS]}"

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/tether/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# One folder per secret: each is the mount point of a volume of its own (docker-compose.yml),
# and an empty volume takes the folder's owner and mode on first use. The superuser's and
# Temporal's database passwords are read by other images' users (PostgreSQL's, Temporal's).
RUN groupadd --system --gid 10001 tether \
    && useradd --system --uid 10001 --gid tether --home-dir /app --shell /usr/sbin/nologin tether \
    && mkdir -p /app /data /keys/payload /keys/state /keys/inbox /keys/public /keys/db-admin /keys/db-temporal /keys/db-worker /keys/db-cli /keys/db-inbox \
    && chown tether:tether /app /data /keys /keys/payload /keys/state /keys/inbox /keys/public /keys/db-admin /keys/db-temporal /keys/db-worker /keys/db-cli /keys/db-inbox \
    && chmod 700 /keys /keys/payload /keys/state /keys/inbox /keys/public /keys/db-worker /keys/db-cli /keys/db-inbox \
    && chmod 755 /keys/db-admin /keys/db-temporal
COPY --from=build /opt/tether /opt/tether
WORKDIR /app
# What the example stack runs from the working directory (`python -m` puts it on the path; the
# package in the venv holds none of it): the billing example's service and tool modules
# (TETHER_TOOLS=examples.billing.tools), the billing policy for the worker (TETHER_POLICY; the
# image's version has no `signed` tenant, whose keys only the dev stack has), the playbook for
# `tether start --playbook`. Owned by root: the service user can read them, not change them.
# tests/operations/test_compose.py lays the image out from these lines.
COPY examples/__init__.py /app/examples/
COPY examples/billing/__init__.py examples/billing/api.py examples/billing/db.py examples/billing/model.py examples/billing/routes.py examples/billing/service.py examples/billing/tools.py /app/examples/billing/
COPY examples/billing/policy.image.toml examples/billing/refund.playbook.json /app/examples/billing/
USER 10001:10001
# Prometheus metrics (worker.py --metrics-port).
EXPOSE 9000
CMD ["python", "-m", "worker", "--metrics-port", "9000"]
