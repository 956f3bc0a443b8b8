# One image for the API, the Celery worker and beat, and the Spark master/worker: Spark
# executors run pgsieve's Python code (psycopg COPY in mapPartitions), so they need the
# same packages, and the driver's pyspark must match the cluster's Spark exactly.
FROM python:3.11-slim-bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.lock pyproject.toml README.md ./
RUN python -m venv /app/.venv \
 && /app/.venv/bin/pip install --no-cache-dir uv==0.13.8 \
 && /app/.venv/bin/uv pip sync --python /app/.venv/bin/python requirements.lock
COPY . .
RUN /app/.venv/bin/uv pip install --python /app/.venv/bin/python --no-deps -e .
ENV PATH="/app/.venv/bin:$PATH" \
    SPARK_HOME=/app/.venv/lib/python3.11/site-packages/pyspark \
    PGSIEVE_HOME=/var/lib/pgsieve
EXPOSE 8000
CMD ["pgsieve", "api", "--host", "0.0.0.0", "--port", "8000"]
