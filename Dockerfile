# One image for the API, the Celery worker and beat, and the Spark master/worker: Spark
# executors run pgsieve's Python code (psycopg COPY in mapPartitions), so they need the
# same packages, and the driver's pyspark must match the cluster's Spark exactly.
# The base image is pinned to an exact release (the Python the lock was resolved with);
# only runtime dependencies are installed (requirements-runtime.lock: no test tools).
FROM python:3.11.7-slim-bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --create-home --home-dir /var/lib/pgsieve --shell /usr/sbin/nologin pgsieve \
 && chmod 0700 /var/lib/pgsieve
WORKDIR /app
COPY requirements-runtime.lock requirements-uv.lock pyproject.toml README.md ./
# uv lives outside the venv: `uv pip sync` leaves the venv exactly as the lock says.
# Every file is checked against the locks' sha256 (--require-hashes), uv's too.
RUN pip install --no-cache-dir --require-hashes --no-deps --only-binary=:all: \
      -r requirements-uv.lock \
 && python -m venv /app/.venv \
 && uv pip sync --require-hashes --python /app/.venv/bin/python requirements-runtime.lock
COPY . .
# The compiled hot path (Cython → C, built with gcc, which leaves the image afterwards).
# pgsieve itself without build isolation: its build backend is the locked setuptools.
RUN uv pip install --python /app/.venv/bin/python --no-deps --no-build-isolation -e . \
 && apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && /app/.venv/bin/python scripts/build_compiled.py \
 && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* build
ENV PATH="/app/.venv/bin:$PATH" \
    SPARK_HOME=/app/.venv/lib/python3.11/site-packages/pyspark \
    PGSIEVE_HOME=/var/lib/pgsieve
# Not root: the services need no privilege, and PGSIEVE_HOME is this user's only.
USER pgsieve
EXPOSE 8000
CMD ["pgsieve", "api", "--host", "0.0.0.0", "--port", "8000"]
