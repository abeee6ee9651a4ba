# CPU node image: head, preprocessing (cpu tier) and sweep (spot tier) nodes.
#   docker build -f platform/docker/cpu.Dockerfile -t strata/strata-cpu:0.1.0 .
FROM rayproject/ray:2.60.0-py311-cpu
ARG TORCH_VERSION=2.13.0
# Optional: PyTorch's CPU-only wheel index, for a smaller image (without it pip takes the default build).
ARG TORCH_INDEX_URL=
WORKDIR /home/ray/strata
COPY --chown=ray platform/requirements.txt platform/requirements.txt
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}" \
 && pip install --no-cache-dir -r platform/requirements.txt
COPY --chown=ray pyproject.toml README.md ./
COPY --chown=ray strata strata
COPY --chown=ray pipelines pipelines
COPY --chown=ray train train
COPY --chown=ray tune tune
COPY --chown=ray infer infer
RUN pip install --no-cache-dir --no-deps -e .
ENV RAY_AUTH_MODE=token
# Every pod of a strata cluster (KubeRay) notices a cut-off peer in about 30 s (platform/ray-network.env).
ENV RAY_grpc_client_keepalive_time_ms=10000 RAY_grpc_client_keepalive_timeout_ms=10000
