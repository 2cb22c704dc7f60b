# syntax=docker/dockerfile:1
# idem's container image (docs/operations.md, "Container image").
#
# Two ways to build the same runtime image:
#
#   docker build -t idem .
#       `runtime`, the last stage: compiles idem in the `build` stage
#       (a cold release build takes over ten minutes on two cores).
#   cargo build --release --locked
#   docker build --target runtime-prebuilt -t idem .
#       `runtime-prebuilt`: copies an already built target/release/idem
#       (built on a glibc no newer than the runtime base's: Debian
#       bookworm's 2.36). The `build` stage is then never run. This is what
#       .ci/image does with podman (`--isolation=chroot --format docker`).
#
# Build arguments: RUST_IMAGE (the build stage's base) and BASE (the
# runtime's, any Debian bookworm with apt).

ARG RUST_IMAGE=rust:1-slim-bookworm
ARG BASE=debian:bookworm-slim

# ---- build: idem from source ------------------------------------------------
FROM ${RUST_IMAGE} AS build
# jemalloc, the default allocator, is compiled from source: a C compiler
# and make.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev make \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# target/ holds at most the binary runtime-prebuilt would copy (see
# .dockerignore): never let it stand in for this build's.
RUN rm -rf target \
 && cargo build --release --locked \
 && install -D -m 0755 target/release/idem /out/idem

# ---- prebuilt: a binary built outside (target/release/idem) -----------------
FROM scratch AS prebuilt
COPY target/release/idem /out/idem

# ---- runtime-base: everything but the binary --------------------------------
FROM ${BASE} AS runtime-base
# ca-certificates for the providers' HTTPS; curl for the HEALTHCHECK.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates curl \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && groupadd --gid 10001 idem \
 && useradd --uid 10001 --gid idem --home-dir /var/lib/idem --no-create-home \
      --shell /usr/sbin/nologin idem \
 && install -d -o idem -g idem -m 0750 /var/lib/idem
# The working directory holds what a relative path names: the embedded
# default's SQLite file (idem.db), a request log file. Mount a volume here
# to keep them.
WORKDIR /var/lib/idem
# Every setting can be overridden as IDEM_<SECTION>__<KEY>; the embedded
# default listens on loopback only, useless in a container.
ENV IDEM_SERVER__LISTEN=0.0.0.0:8080
EXPOSE 8080
# The port is taken from IDEM_SERVER__LISTEN, so a changed listen address
# keeps the check right (a `listen` set only in a config file does not).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD curl -fsS "http://127.0.0.1:${IDEM_SERVER__LISTEN##*:}/healthz" || exit 1
USER idem
ENTRYPOINT ["idem"]
CMD ["serve"]

# ---- runtime-prebuilt: the runtime with target/release/idem -----------------
FROM runtime-base AS runtime-prebuilt
COPY --from=prebuilt /out/idem /usr/local/bin/idem

# ---- runtime (default): the runtime with the binary of the build stage ------
FROM runtime-base AS runtime
COPY --from=build /out/idem /usr/local/bin/idem
