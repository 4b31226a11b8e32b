# The Preheat operator: Python and the operator's own dependencies, no torch.
#   docker build -f docker/operator.Dockerfile -t ghcr.io/preheat/operator:0.1.0 .
# Local (no registry, no daemon): scripts/build-images passes a Debian bookworm base made
# here and a wheelhouse (BASE_IMAGE, PIP_SOURCE="--no-index --find-links /wheelhouse").
ARG BASE_IMAGE=python:3.11-slim

# ---- build: the wheel and the environment ----
FROM ${BASE_IMAGE} AS build
ARG PIP_SOURCE=""
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/preheat
ENV PATH=/opt/preheat/bin:$PATH
COPY docker/wheelhouse/ /wheelhouse/
# The operator's own needs only (before the sources, so a layer cache keeps this layer):
# the engine's torch stack stays out of this image.
# The router (`preheat router`, run from this image by default) adds starlette and uvicorn.
RUN pip install $PIP_SOURCE "kopf>=1.37" "aiohttp>=3.9" "pyyaml>=6" "httpx>=0.27" "prometheus-client>=0.20" \
    "starlette>=0.37" "uvicorn>=0.29"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY cli/ cli/
COPY engine/ engine/
COPY operator/ operator/
COPY router/ router/
# Preheat from its wheel, with --no-deps.
RUN pip wheel $PIP_SOURCE --no-deps --wheel-dir /tmp/dist . && \
    pip install $PIP_SOURCE --no-deps /tmp/dist/preheat-*.whl

# ---- the image ----
FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/preheat/bin:$PATH
COPY --from=build /opt/preheat /opt/preheat
RUN useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin preheat
USER 1000:1000
WORKDIR /tmp
ENTRYPOINT ["preheat"]
CMD ["operator", "--standalone"]
