# The Preheat operator: slim Python, no torch.
#   docker build -f docker/operator.Dockerfile -t ghcr.io/preheat/operator:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli/ cli/
COPY engine/ engine/
COPY operator/ operator/
# --no-deps + the operator's own needs only: the engine's torch stack stays out of this image.
RUN pip install --no-deps . && \
    pip install "kopf>=1.37" "aiohttp>=3.9" "pyyaml>=6" "httpx>=0.27" "prometheus-client>=0.20" && \
    rm -rf /src

RUN useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin preheat
USER 1000:1000
WORKDIR /tmp
ENTRYPOINT ["preheat"]
CMD ["operator", "--standalone"]
