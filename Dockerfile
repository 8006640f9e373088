FROM python:3.11-slim
# ringwatch runs as an unprivileged user; a fixed uid lets a host volume or a pod's
# securityContext (runAsNonRoot) match it.
RUN groupadd --system --gid 10001 ringwatch \
    && useradd --system --uid 10001 --gid ringwatch --home-dir /home/ringwatch --create-home \
       --shell /usr/sbin/nologin ringwatch
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY agents agents
COPY services services
COPY api api
COPY migrations migrations
# The code stays root's and read-only to the service; only the state dir (the spool, the
# scheduler's rotation) is its own. A named volume mounted there starts with this ownership.
RUN pip install --no-cache-dir -c constraints.txt -e . \
    && mkdir -p /app/.ringwatch \
    && chown ringwatch:ringwatch /app/.ringwatch
ENV RINGWATCH_STATE_DIR=/app/.ringwatch
USER 10001:10001
ENTRYPOINT []
