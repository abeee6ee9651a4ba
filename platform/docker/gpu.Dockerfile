# GPU node image: training (gpu tier) nodes. Same code and pinned deps as cpu.Dockerfile;
# torch is the CUDA build of the same version.
#   docker build -f platform/docker/gpu.Dockerfile -t strata/strata-gpu:0.1.0 .
FROM rayproject/ray:2.60.0-py311-gpu
ARG TORCH_VERSION=2.13.0
WORKDIR /home/ray/strata
COPY --chown=ray platform/requirements.txt platform/requirements.txt
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
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
