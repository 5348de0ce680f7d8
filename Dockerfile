# The jobtier image: one image for every process (api, worker, scheduler, persister,
# migrate); the compose file picks the command. Build from the repository root:
#   docker build -t jobtier .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# an unprivileged user owns nothing but its home: the code is installed as root, read-only
RUN groupadd --system jobtier && useradd --system --gid jobtier --create-home jobtier

WORKDIR /src
# README.md is the package's long description; the wildcard lets a tree without one build
COPY pyproject.toml README.md* ./
COPY src ./src
# the extras a deployment may switch on by setting alone: encryption at rest
# (JOBTIER_ENCRYPTION_KEYS) and OTLP tracing
RUN pip install ".[crypto,otlp]" && rm -rf /src

USER jobtier
WORKDIR /home/jobtier
# the API listens on 127.0.0.1 unless told otherwise; in a container it must not
ENV JOBTIER_API_HOST=0.0.0.0
EXPOSE 8000
ENTRYPOINT ["jobtier"]
CMD ["--help"]
