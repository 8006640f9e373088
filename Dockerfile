# syntax=docker/dockerfile:1
# ringwatch's images, one per role (docs/operations.md, "Images"):
#
#   docker build --target api   -t ringwatch-api:0.2.0 .    the API, the notifier, `ringwatch db
#                                                            upgrade` and the client; no torch, no Ray
#   docker build --target agent -t ringwatch-agent:0.2.0 .  the scheduler, the Ray head and workers
#                                                            and the GPU probe agents; CUDA, RDMA, EFA
#
# Each installs its role's lock file (requirements/<role>.lock, made by `make lock`) with
# --no-deps and --require-hashes, so the image holds exactly the packages the lock names, then
# ringwatch's own wheel, not editable. A plain `docker build .` makes the last stage, api.

# This ringwatch's version (pyproject's; tests/test_images.py holds them equal), labelled on
# each image as it is tagged: docker build --target api -t ringwatch-api:0.2.0 .
ARG RINGWATCH_VERSION=0.2.0
ARG PYTHON_IMAGE=python:3.11-slim-trixie
# The CUDA of the agent's torch: requirements/agent.lock pins torch from PyPI, whose Linux wheel
# is the CUDA 13.0 build (NCCL and the CUDA libraries come as its nvidia-* wheels); it needs an
# NVIDIA driver of 580 or later on the GPU nodes.
ARG CUDA_VERSION=13.0.1
# The AWS OFI NCCL plugin (NCCL over libfabric, for EFA), built from the release tarball at
# https://github.com/aws/aws-ofi-nccl/releases. Set AWS_OFI_NCCL_SHA256 to have the tarball
# checked before it is built.
ARG AWS_OFI_NCCL_VERSION=1.19.2
ARG AWS_OFI_NCCL_SHA256=

# -- ringwatch's wheel: pure Python, installed by both roles -------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agents agents
COPY services services
COPY api api
COPY migrations migrations
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -- the AWS OFI NCCL plugin, against the distribution's libfabric ------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS aws-ofi-nccl
ARG AWS_OFI_NCCL_VERSION
ARG AWS_OFI_NCCL_SHA256
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential ca-certificates curl \
       libfabric-dev libhwloc-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /build
RUN curl -fsSLo plugin.tar.gz "https://github.com/aws/aws-ofi-nccl/releases/download/v${AWS_OFI_NCCL_VERSION}/aws-ofi-nccl-${AWS_OFI_NCCL_VERSION}.tar.gz" \
    && if [ -n "${AWS_OFI_NCCL_SHA256}" ]; then \
         printf '%s  plugin.tar.gz\n' "${AWS_OFI_NCCL_SHA256}" > plugin.sha256 && sha256sum -c plugin.sha256; \
       fi \
    && tar -xzf plugin.tar.gz --strip-components=1 \
    && ./configure --prefix=/opt/aws-ofi-nccl --with-cuda=/usr/local/cuda --enable-platform-aws \
       --disable-tests \
    && make -j"$(nproc)" \
    && make install \
    && rm -f /opt/aws-ofi-nccl/lib/libnccl-net.so
# Without the libnccl-net.so link NCCL loads the plugin only when asked (NCCL_NET_PLUGIN=ofi,
# on EFA): on InfiniBand and RoCE NCCL's own verbs transport stays the one measured.

# -- agent: the scheduler, Ray, the probe agents --------------------------------------------------
# nvidia/cuda's base flavour rather than a PyTorch image: it carries what the NVIDIA container
# runtime reads (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES) and no CUDA libraries of its
# own, so the torch, NCCL and CUDA libraries are the locked wheels alone, not a second copy in
# another version. Python is Ubuntu 24.04's 3.12.
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04 AS agent
ARG RINGWATCH_VERSION
LABEL org.opencontainers.image.title="ringwatch" \
      org.opencontainers.image.version="${RINGWATCH_VERSION}"
# rdma-core's verbs library and providers (mlx5, efa, ...) for NCCL's InfiniBand/RoCE
# transport and ibv_devinfo to look at the NICs; libfabric (with fi_info) and hwloc for the
# OFI plugin; tini as PID 1 forwards signals and reaps the processes Ray leaves behind. The
# tools' packages bring the libraries, whatever names Ubuntu gives those.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv tini \
       ibverbs-providers ibverbs-utils libfabric-bin hwloc-nox \
    && rm -rf /var/lib/apt/lists/*
# ringwatch runs as an unprivileged user; a fixed uid lets a host volume or a pod's
# securityContext (runAsNonRoot) match it.
RUN groupadd --system --gid 10001 ringwatch \
    && useradd --system --uid 10001 --gid ringwatch --home-dir /home/ringwatch --create-home --shell /usr/sbin/nologin ringwatch
ENV VIRTUAL_ENV=/opt/venv
ENV PATH=/opt/venv/bin:$PATH
ENV PYTHONUNBUFFERED=1
COPY requirements/agent.lock /tmp/requirements.lock
RUN python3.12 -m venv /opt/venv \
    && pip install --no-cache-dir --no-deps --require-hashes --only-binary :all: -r /tmp/requirements.lock \
    && rm /tmp/requirements.lock
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-deps /tmp/wheels/ringwatch-*.whl \
    && rm -rf /tmp/wheels
COPY --from=aws-ofi-nccl /opt/aws-ofi-nccl /opt/aws-ofi-nccl
ENV LD_LIBRARY_PATH=/opt/aws-ofi-nccl/lib:$LD_LIBRARY_PATH
# The code is root's and read-only to the service; only the state dir (the spool, the
# scheduler's rotation) and the agent token's dir are its own. A named volume mounted there
# starts with this ownership.
RUN mkdir -p /app/.ringwatch /run/ringwatch \
    && chown ringwatch:ringwatch /app/.ringwatch /run/ringwatch \
    && chmod 0700 /run/ringwatch
ENV RINGWATCH_STATE_DIR=/app/.ringwatch
WORKDIR /app
USER 10001:10001
ENTRYPOINT ["/usr/bin/tini", "--"]
# Alone on a GPU host (docker run --gpus all ringwatch-agent): probe this machine's GPUs.
CMD ["ringwatch", "selftest"]

# -- api: the API, the notifier, migrations, the client -------------------------------------------
FROM ${PYTHON_IMAGE} AS api
ARG RINGWATCH_VERSION
LABEL org.opencontainers.image.title="ringwatch" \
      org.opencontainers.image.version="${RINGWATCH_VERSION}"
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 ringwatch \
    && useradd --system --uid 10001 --gid ringwatch --home-dir /home/ringwatch --create-home --shell /usr/sbin/nologin ringwatch
ENV VIRTUAL_ENV=/opt/venv
ENV PATH=/opt/venv/bin:$PATH
ENV PYTHONUNBUFFERED=1
COPY requirements/api.lock /tmp/requirements.lock
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --no-deps --require-hashes --only-binary :all: -r /tmp/requirements.lock \
    && rm /tmp/requirements.lock
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-deps /tmp/wheels/ringwatch-*.whl \
    && rm -rf /tmp/wheels
RUN mkdir -p /app/.ringwatch /run/ringwatch \
    && chown ringwatch:ringwatch /app/.ringwatch /run/ringwatch \
    && chmod 0700 /run/ringwatch
ENV RINGWATCH_STATE_DIR=/app/.ringwatch
WORKDIR /app
USER 10001:10001
EXPOSE 8420
# Healthy while the API process answers (/healthz, liveness: it asks no database, so an
# orchestrator that restarts unhealthy containers does not restart them all for a database
# outage; docker-compose.yml gates its dependents on /readyz instead). urllib, as the slim
# image has no curl.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8420/healthz', timeout=4)"]
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["ringwatch", "serve", "--host", "0.0.0.0", "--port", "8420"]
