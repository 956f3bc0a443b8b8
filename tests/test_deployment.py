"""docker-compose.yml parses and wires the production-like services by settings alone."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_services():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name in ("source", "target", "redis", "api", "worker", "beat", "spark-master",
                 "spark-worker", "metadata"):
        assert name in services, name
    assert "wal_level=logical" in services["source"]["command"]
    assert services["beat"]["deploy"]["replicas"] == 1
    for name in ("api", "worker", "beat"):
        env = services[name]["environment"]
        assert env["PGSIEVE_BROKER_URL"].startswith("redis://")
        assert env["PGSIEVE_DATABASE_URL"].startswith("postgresql")
        assert env["PGSIEVE_SPARK_MASTER"] == "spark://spark-master:7077"
        assert services[name]["command"][0] == "pgsieve"
    assert services["worker"]["command"] == ["pgsieve", "worker"]
    assert services["beat"]["command"] == ["pgsieve", "beat"]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make run" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
