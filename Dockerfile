# The rankscope reference trainer (exporter + trainer), CPU by default.
#
#   docker build -t rankscope-trainer .                       # CPU torch wheels
#   docker build --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t rankscope-trainer .   # CUDA wheels
#
# docker-compose.yml builds this image and runs it as two ranks under torchrun;
# docker-compose.gpu.yml switches to the CUDA wheels and a GPU device.
FROM python:3.11-slim

# CPU-only wheels keep the image small; PyPI's Linux torch wheels bundle CUDA.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# torch first, from the chosen index, in its own layer: it is by far the largest
# and changes least. The versions match the caps in pyproject.toml.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==2.14.1" "torchvision==0.29.1"

COPY pyproject.toml README.md ./
COPY exporter ./exporter
COPY trainer ./trainer
RUN pip install .

# Run unprivileged; checkpoints go to a volume mounted at /checkpoints.
RUN useradd --create-home --uid 10001 rankscope \
    && mkdir -p /checkpoints \
    && chown rankscope /checkpoints
USER rankscope

# 9400 + local rank: each rank's /metrics. 9300: rank 0's control endpoint.
EXPOSE 9300 9400 9401

# Two ranks of the demo config; CMD adds flags (metrics reachable from outside
# the container; the control endpoint stays on the container's loopback unless
# a token is configured, see docker-compose.yml).
ENTRYPOINT ["torchrun", "--standalone", "--nproc_per_node=2", "-m", "rankscope_trainer", "--config", "trainer/rankscope_trainer/configs/demo.yaml"]
CMD ["--set", "metrics.host=0.0.0.0"]
