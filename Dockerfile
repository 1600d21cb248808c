# Images of the Upsquad services, one target each, from one build of the tree on Debian 12
# (bookworm) with Debian's packages only, as scripts/deps.sh declares them:
#
#   docker build --target workflow-engine -t upsquad/workflow-engine:TAG .
#   (targets: workflow-engine orchestrator stream-hub model-registry devworker dbtools)
#
# Every image runs as uid/gid 65532, holds its executable in /usr/local/bin (ENTRYPOINT, so the
# manifests' `args: ["--migrate"]` runs the migrations), the health probe
# /usr/local/bin/upsquad-health the manifests' probes call, and its data under
# /usr/share/upsquad/<service>/ (migrations, the definition schema and tool catalogue, the model
# catalogue): the paths k8s/base names. dbtools is psql for the database bootstrap Job.
# docs/operations.md has the build and the release steps.

FROM debian:bookworm AS build
ENV DEBIAN_FRONTEND=noninteractive
# the build section of scripts/deps.sh (libcmocka-dev: the Makefile's preflight checks it)
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends \
      make gcc pkg-config ca-certificates \
      libgrpc-dev protobuf-compiler protobuf-c-compiler libprotobuf-c-dev libprotobuf-dev \
      libpq-dev libhiredis-dev libnats-dev libcjson-dev libssl-dev libmicrohttpd-dev \
      libcmocka-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Makefile ./
COPY libcommon libcommon
COPY proto proto
COPY services services
COPY tools tools
COPY tests tests
COPY bench bench
COPY scripts scripts
RUN make -j"$(nproc)" \
      build/bin/workflow-engine build/bin/orchestrator build/bin/stream-hub \
      build/bin/model-registry build/bin/devworker build/bin/upsquad-health \
 && mkdir -p /out/bin /out/share \
 && cp build/bin/workflow-engine build/bin/orchestrator build/bin/stream-hub \
       build/bin/model-registry build/bin/devworker build/bin/upsquad-health /out/bin/ \
 && strip /out/bin/* \
 && for s in workflow-engine orchestrator stream-hub model-registry; do \
      mkdir -p /out/share/$s && cp -r services/$s/migrations /out/share/$s/; done \
 && cp -r services/workflow-engine/schema services/workflow-engine/catalog /out/share/workflow-engine/ \
 && cp -r services/model-registry/catalog /out/share/model-registry/

# The shared runtime: the libraries the executables link (their dependencies follow), CA roots
# for TLS to managed datastores, the unprivileged user.
FROM debian:bookworm-slim AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends \
      libgrpc29 libprotobuf-c1 libpq5 libhiredis0.14 libnats3.4 libcjson1 libssl3 \
      libmicrohttpd12 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd -g 65532 upsquad && useradd -u 65532 -g 65532 -M -d /nonexistent -s /usr/sbin/nologin upsquad
COPY --from=build /out/bin/upsquad-health /usr/local/bin/
USER 65532:65532

FROM runtime AS workflow-engine
COPY --from=build /out/bin/workflow-engine /usr/local/bin/
COPY --from=build /out/share/workflow-engine /usr/share/upsquad/workflow-engine
ENTRYPOINT ["/usr/local/bin/workflow-engine"]

FROM runtime AS orchestrator
COPY --from=build /out/bin/orchestrator /usr/local/bin/
COPY --from=build /out/share/orchestrator /usr/share/upsquad/orchestrator
ENTRYPOINT ["/usr/local/bin/orchestrator"]

FROM runtime AS stream-hub
COPY --from=build /out/bin/stream-hub /usr/local/bin/
COPY --from=build /out/share/stream-hub /usr/share/upsquad/stream-hub
ENTRYPOINT ["/usr/local/bin/stream-hub"]

FROM runtime AS model-registry
COPY --from=build /out/bin/model-registry /usr/local/bin/
COPY --from=build /out/share/model-registry /usr/share/upsquad/model-registry
ENTRYPOINT ["/usr/local/bin/model-registry"]

FROM runtime AS devworker
COPY --from=build /out/bin/devworker /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/devworker"]

FROM debian:bookworm-slim AS dbtools
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends postgresql-client ca-certificates \
 && rm -rf /var/lib/apt/lists/*
USER 65532:65532
