"""docker-compose.yml parses and wires the production-like services by settings alone."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
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


def _compose_text() -> str:
    return (ROOT / "docker-compose.yml").read_text()


def test_compose_has_no_default_secrets():
    """Issue 17, hole 4/8: every secret is required from .env (``${VAR:?message}``);
    nothing ships a placeholder such as ``change-me``."""
    text = _compose_text()
    assert "change-me" not in text
    compose = yaml.safe_load(text)
    services = compose["services"]
    for name in ("api", "worker", "beat", "migrate"):
        env = services[name]["environment"]
        for key in ("PGSIEVE_API_TOKEN", "PGSIEVE_SECRET_KEY"):
            assert env[key].startswith(f"${{{key}:?"), (name, key)
        assert ":?" in env["PGSIEVE_DATABASE_URL"] and ":?" in env["PGSIEVE_BROKER_URL"]
    for name in ("source", "target", "metadata"):
        assert services[name]["environment"]["POSTGRES_PASSWORD"].startswith("${"), name


def test_compose_redis_has_a_password_and_nothing_internal_is_public():
    services = yaml.safe_load(_compose_text())["services"]
    redis = services["redis"]
    assert "--requirepass" in " ".join(redis["command"])
    assert "ports" not in redis
    assert "@redis:6379" in services["api"]["environment"]["PGSIEVE_BROKER_URL"]
    for name, service in services.items():
        for port in service.get("ports", []):
            host = str(port).rsplit(":", 2)[0]
            assert host in ("127.0.0.1", "${PGSIEVE_API_BIND:-127.0.0.1}"), (name, port)


def test_image_has_no_dev_dependencies_and_pinned_bases():
    dockerfile = (ROOT / "Dockerfile").read_text()
    froms = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("FROM ")]
    assert froms
    for image in froms:
        tag = image.split("@")[0].split(":")[-1]
        # an exact release (3.11.7-…) or a digest; never a floating 3.11 / latest
        assert "@sha256:" in image or tag.count(".") >= 2, image
    assert "requirements-runtime.lock" in dockerfile and "requirements.lock " not in dockerfile
    runtime = (ROOT / "requirements-runtime.lock").read_text().lower()
    for dev in ("pytest", "mypy", "ruff", "playwright", "hypothesis", "import-linter"):
        assert f"\n{dev}==" not in runtime, dev
    for image in (s["image"] for s in yaml.safe_load(_compose_text())["services"].values()
                  if "image" in s and not s["image"].startswith("pgsieve")):
        assert image.split(":")[-1].count(".") >= 1, image
    assert ".env" in (ROOT / ".dockerignore").read_text().split()


REQUIRED_SECRETS = ("EXAMPLE_DB_PASSWORD", "PGSIEVE_API_TOKEN", "PGSIEVE_METADATA_PASSWORD",
                    "PGSIEVE_REDIS_PASSWORD", "PGSIEVE_SECRET_KEY", "PGSIEVE_SPARK_AUTH_SECRET")


def _compose_command() -> list[str]:
    """Docker's compose plugin, else the standalone docker-compose (scripts/bootstrap.sh
    installs Debian's where neither is present)."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 check=False).returncode == 0:
        return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    assert standalone, ("neither `docker compose` nor docker-compose is installed: "
                        "`make deps` installs Debian's (as root), or install either")
    return [standalone]


def _compose_config(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env_file = tmp_path / "compose.env"  # only what the test gives: never a developer's .env
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    clean = {k: v for k, v in os.environ.items() if k not in REQUIRED_SECRETS}
    return subprocess.run(
        [*_compose_command(), "--env-file", str(env_file), "-f", str(ROOT / "docker-compose.yml"),
         "config"], capture_output=True, text=True, check=False, cwd=ROOT, env=clean,
        timeout=120)


def test_compose_itself_accepts_the_deployment_once_its_secrets_are_set(tmp_path: Path):
    """Compose's own validation (its schema, interpolation, references between services),
    not a restatement of the file: the deployment is what `docker compose up` would run."""
    secrets = {name: f"{name.lower()}-value-0123456789" for name in REQUIRED_SECRETS}
    done = _compose_config(tmp_path, secrets)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    assert resolved["worker"]["environment"]["PGSIEVE_SPARK_AUTH_SECRET"] == \
        secrets["PGSIEVE_SPARK_AUTH_SECRET"]
    assert secrets["PGSIEVE_REDIS_PASSWORD"] in \
        resolved["worker"]["environment"]["PGSIEVE_BROKER_URL"]
    assert f"-Dspark.authenticate.secret={secrets['PGSIEVE_SPARK_AUTH_SECRET']}" in \
        resolved["spark-worker"]["environment"]["SPARK_WORKER_OPTS"]


@pytest.mark.parametrize("missing", REQUIRED_SECRETS)
def test_compose_refuses_the_deployment_while_a_secret_is_unset(tmp_path: Path, missing: str):
    secrets = {name: f"{name.lower()}-value-0123456789" for name in REQUIRED_SECRETS
               if name != missing}
    done = _compose_config(tmp_path, secrets)
    assert done.returncode != 0
    assert f"set {missing} in .env" in done.stderr + done.stdout


def _commands(path: str) -> list[str]:
    """The shell commands of a script or Dockerfile, continuation lines joined."""
    text = (ROOT / path).read_text().replace("\\\n", " ")
    return [" ".join(part.split()) for line in text.splitlines()
            for part in line.split("&&") if not line.lstrip().startswith("#")]


def test_every_install_checks_the_locks_hashes():
    """Issue 54: every lock carries a sha256 for each file it may install, and every
    install — uv itself included — is made with --require-hashes; pgsieve's own
    editable install takes no dependency and builds with the locked setuptools."""
    for lock in ("requirements.lock", "requirements-runtime.lock", "requirements-uv.lock"):
        text = (ROOT / lock).read_text()
        pins = re.findall(r"^([A-Za-z0-9_.-]+==\S+)((?: \\\n +--hash=sha256:[0-9a-f]{64})*)",
                          text, re.MULTILINE)
        assert pins, lock
        assert all(hashes for _, hashes in pins), [p for p, h in pins if not h]
    installs = [c for path in ("scripts/bootstrap.sh", "Dockerfile") for c in _commands(path)
                if re.search(r"\bpip (install|sync)\b", c)]
    assert len(installs) >= 6, installs
    for command in installs:
        if " -e ." in command:
            assert "--no-deps" in command and "--no-build-isolation" in command, command
        else:
            assert "--require-hashes" in command, command
            assert re.search(r"(-r|sync .*) \S+\.lock\b", command), command
