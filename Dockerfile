# syntax=docker/dockerfile:1
#
# Prism container images: one build stage, two runtime targets.
#
#   docker build --target cpu-runtime  -t prism:dev .        # head, router, CPU workers, CLI
#   docker build --target cuda-runtime -t prism:dev-cuda .   # GPU workers (CUDA 13.0 libraries)
#   docker build --target cpu-demo     -t prism:demo .       # cpu-runtime + the bundled model
#                                                            # (k8s/overlays/cpu, laptop clusters)
#
# Both runtime images hold only the four binaries (`prism-head`, `prism-worker`,
# `prism-router`, `prism`), CA certificates and a non-root user (uid/gid 10001):
# no compiler, no package manager caches, no sources. The CUDA libraries
# (cuBLAS, cuBLASLt, NVRTC, NCCL) come from NVIDIA's runtime image; the driver
# comes from the node through the NVIDIA container toolkit.

ARG RUST_VERSION=1.95
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
ARG DEBIAN_IMAGE=debian:bookworm-slim

# ---------------------------------------------------------------- build
FROM rust:${RUST_VERSION}-slim-bookworm AS build
# protoc and the well-known protos are needed by prism-common's and
# etcd-client's build scripts. Pinned to bookworm's protobuf 3.21.12 series
# (the glob keeps Debian security rebuilds installable).
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      'protobuf-compiler=3.21.12-*' 'libprotobuf-dev=3.21.12-*' \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The workspace only: sources and protos (no models, no build outputs).
COPY Cargo.toml Cargo.lock ./
COPY proto proto
COPY common common
COPY head head
COPY worker worker
COPY router router
COPY cli cli
COPY tests tests
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked \
      -p prism-head -p prism-worker -p prism-router -p prism-cli \
 && mkdir -p /out /out-cuda \
 && cp target/release/prism-head target/release/prism-worker \
       target/release/prism-router target/release/prism /out/ \
 && cargo build --release --locked -p prism-worker --features cuda \
 && cp target/release/prism-worker /out-cuda/
# The second build is the GPU worker: cudarc loads the CUDA libraries at run time, so it
# builds without CUDA; on a node without a GPU it falls back to the CPU backend.

# ---------------------------------------------------------------- CPU runtime
FROM ${DEBIAN_IMAGE} AS cpu-runtime
LABEL org.opencontainers.image.title="prism" \
      org.opencontainers.image.description="Prism LLM serving: head, worker (CPU), router, CLI" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 prism \
 && useradd --system --uid 10001 --gid prism --home-dir /var/lib/prism \
      --create-home --shell /usr/sbin/nologin prism \
 && mkdir -p /models \
 && chown prism:prism /models
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /out/ /usr/local/bin/
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
USER 10001:10001
WORKDIR /var/lib/prism
# gRPC and HTTP ports: head 50050/8081, worker 50061/8082, router 8000/50051.
EXPOSE 8000 8081 8082 50050 50051 50061
ENTRYPOINT ["/usr/local/bin/prism"]
CMD ["--help"]

# ---------------------------------------------------------------- CPU demo (bundled model)
# The CPU image plus SmolLM2-135M-Instruct (Q4_1 GGUF, ~90 MB) at
# /opt/prism/models, so a laptop cluster serves a real model with no volume
# to fill. Fetch the model into models/ first (see README).
FROM cpu-runtime AS cpu-demo
COPY --chown=root:root models/SmolLM2-135M-Instruct.Q4_1.gguf /opt/prism/models/

# ---------------------------------------------------------------- CUDA headers (build-time only)
FROM ${CUDA_DEVEL_IMAGE} AS build-cuda-headers

# ---------------------------------------------------------------- CUDA runtime (workers)
FROM ${CUDA_IMAGE} AS cuda-runtime
LABEL org.opencontainers.image.title="prism-cuda" \
      org.opencontainers.image.description="Prism LLM serving with the CUDA backend (CUDA 13.0 runtime)" \
      org.opencontainers.image.licenses="Apache-2.0"
# Ubuntu 24.04 images ship a uid-1000 "ubuntu" user; Prism uses its own.
RUN groupadd --system --gid 10001 prism \
 && useradd --system --uid 10001 --gid prism --home-dir /var/lib/prism \
      --create-home --shell /usr/sbin/nologin prism \
 && mkdir -p /models \
 && chown prism:prism /models
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /out/ /usr/local/bin/
COPY --from=build /out-cuda/prism-worker /usr/local/bin/prism-worker
# The kernels are compiled at run time by NVRTC (in the runtime image) and include
# cuda_bf16.h, which only the toolkit's headers ship: copied from the devel image.
COPY --from=build-cuda-headers /usr/local/cuda/include/ /usr/local/cuda/include/
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /var/lib/prism
EXPOSE 8082 50061
ENTRYPOINT ["/usr/local/bin/prism-worker"]
