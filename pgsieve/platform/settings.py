"""The one settings object, read from ``PGSIEVE_*`` environment variables and ``.env``.

Embedded defaults make a fresh checkout work with nothing configured: the metadata store
is a SQLite file and the Celery broker a folder under ``PGSIEVE_HOME`` (``.pgsieve``);
the API token and the credential-encryption key are generated once and kept there too.
In production every one of these is set explicitly (PostgreSQL, Redis, a Spark master).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pgsieve.platform.credentials import SecretBox
from pgsieve.platform.hostpolicy import ConnectionPolicy
from pgsieve.platform.keyring import credential_box

#: The shortest PGSIEVE_API_TOKEN / PGSIEVE_SECRET_KEY `pgsieve api` and `worker` accept.
MIN_SECRET_LENGTH = 16
#: Placeholders that are never a secret (the old compose file shipped the first two).
WEAK_SECRETS = frozenset({
    "change-me", "change-me-too", "changeme", "change_me", "secret", "password",
    "pgsieve", "token", "admin", "test", "example", "default",
})


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PGSIEVE_", env_file=".env", env_file_encoding="utf-8", extra="ignore"
    )

    home: Path = Field(
        default=Path(".pgsieve"),
        description="State directory for embedded defaults (SQLite file, broker, keys).",
    )
    database_url: str | None = Field(
        default=None, description="Metadata store; default sqlite:///<home>/pgsieve.db"
    )
    broker_url: str | None = Field(
        default=None,
        description="Celery broker (redis://… in production); default a filesystem broker.",
    )
    api_token: SecretStr | None = Field(default=None, description="Bearer token for the API.")
    secret_key: SecretStr | None = Field(
        default=None, description="Key that encrypts stored credentials (DSN passwords)."
    )
    secret_key_previous: SecretStr | None = Field(
        default=None,
        description="Earlier secret keys, comma-separated: stored credentials they "
        "encrypted still decrypt (until `pgsieve secrets rotate` re-encrypts them).",
    )
    demo: bool = Field(
        default=False,
        description="set by `pgsieve run` for its own api/worker: generated secrets allowed",
    )
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, le=1 << 30,
        description="request bodies over this many bytes get 413 payload_too_large",
    )
    spark_master: str = Field(default="local[*]", description="Spark master URL.")
    spark_conf: dict[str, str] = Field(
        default_factory=dict,
        description="extra Spark properties as a JSON object (PGSIEVE_SPARK_CONF)",
    )
    spark_ship_code: Literal["auto", "always", "never"] = Field(
        default="auto", description="ship pgsieve's Python sources with its Spark jobs "
        "(a zip added to the session): auto — for every master but local; always; never "
        "— the executors have pgsieve installed",
    )
    spark_apply_min_changes: int | Literal["auto"] = Field(
        default="auto",
        description="batches with at least this many changes are planned and staged by "
        "Spark tasks; 0: never; auto: never in local mode, and on a cluster with at least 32 "
        "task slots (more than this machine has cores) from the measured crossover on "
        "(see pgsieve/apply/engine.py choose_apply_path)",
    )
    spark_copy_min_mb: int = Field(
        default=64, ge=0,
        description="an initial copy (local Spark master) of less than this many MB in all "
        "is piped by the worker itself, as many partitions at once as Spark has task slots: "
        "a Spark job for it costs a JVM's start (seconds of CPU) and parallelises nothing "
        "more; 0: Spark for every copy of several partitions",
    )
    diff_spark_min_rows: int | Literal["auto"] = Field(
        default="auto",
        description="a whole-table diff (mode diff) of a table with at least this many "
        "rows and one integer key compares it by key ranges in Spark tasks; 0: never; auto: "
        "from the size above which the worker would not hold both ends' keys and hashes "
        "itself (20,000,000 rows)",
    )
    spark_executor_wait_seconds: float = Field(
        default=15.0, ge=0.0, le=3600.0,
        description="a diff's Spark key ranges, and a copy's plan on a cluster (its task "
        "slots), wait this long for the worker's Spark application (its start, an "
        "executor), then compare at the target / plan for what Spark says; a copy's "
        "ranges never wait (the worker pipes them until Spark is ready), nor does a "
        "stream's batch (without an executor it applies in the driver). A standalone "
        "cluster gives an application every core unless spark.cores.max is set, and a "
        "second worker's application then gets none",
    )
    reconcile_merge_while_reading: bool = Field(
        default=True,
        description="a moved-rows reconciliation whose stream waits at the change's marker "
        "merges the rows as it reads them, in one target transaction, instead of staging "
        "them for the stream (see docs/filter-changes.md)",
    )
    reconcile_park_wait_seconds: float = Field(
        default=1.0, ge=0.0, le=60.0,
        description="how long a moved-rows job waits for its stream to reach the marker "
        "before it stages the rows instead (a caught-up stream gets there within "
        "milliseconds; one that is behind catches up while the rows are staged)",
    )
    hot_path: Literal["auto", "compiled", "python"] = Field(
        default="auto",
        description="the apply's per-change hot path: auto — compiled when make deps built "
        "it, else the pure-Python reference (slower; logged at start and shown in /healthz); "
        "compiled — a worker refuses to start without it; python — the reference",
    )
    spark_auth_secret: SecretStr | None = Field(
        default=None,
        description="shared secret for Spark's RPC authentication and encryption with a "
        "standalone cluster (its master and workers run with the same "
        "spark.authenticate.secret); Kubernetes and YARN generate one per application",
    )
    spark_allow_insecure: bool = Field(
        default=False,
        description="allow a standalone Spark master without PGSIEVE_SPARK_AUTH_SECRET: "
        "database credentials then reach executors over unencrypted RPC",
    )
    pg_bindir: str | None = Field(default=None, description="PostgreSQL server binaries.")
    connect_timeout: int = Field(
        default=5, ge=1, le=120,
        description="Seconds, for DSNs (a connection attempt is capped at 30 whatever this "
        "or the DSN says)")
    statement_timeout_ms: int = Field(
        default=15_000, ge=100,
        description="statement_timeout of control-plane sessions on sources and targets "
        "(API calls, filter previews and validation, inspections); streaming sessions "
        "(initial-sync COPY, decoding, replication, apply) run with 0 and bound their work "
        "otherwise",
    )
    allowed_hosts: str = Field(
        default="",
        description="comma-separated host names, IP addresses or CIDRs (each optionally "
        "with :port or :low-high) that sources and targets may be on; '*' allows any host. "
        "Empty (the default): none — a DSN outside the list is refused with "
        "connection_not_allowed. The demo allows its own local clusters.",
    )
    dsn_allow: str = Field(
        default="",
        description="DSN features refused unless listed here (comma-separated): "
        "unix_socket, hostaddr, passfile, service, ssl_files, gss",
    )
    api_concurrency_per_token: int = Field(
        default=4, ge=1, le=1000,
        description="API requests one token may have using databases (sources, targets) "
        "at once; more get 429 too_many_requests with Retry-After",
    )
    api_concurrency_per_database: int = Field(
        default=8, ge=1, le=1000,
        description="API requests that may use one source or target database at once, "
        "all tokens together; more get 429 too_many_requests with Retry-After",
    )
    failed_auth_per_minute: int = Field(
        default=30, ge=1, le=100_000,
        description="failed authentications one client address gets answered with 401 in "
        "a minute; the rest of that minute 429 too_many_requests (all are counted in the "
        "audit log, one record per route, client and minute)",
    )
    audit_retention_days: int = Field(
        default=365, ge=1, le=36_500,
        description="audit records older than this many days are deleted (beat, hourly)",
    )
    preview_exact_row_limit: int = Field(
        default=2_000_000, ge=0,
        description="filter preview counts exactly up to this many (estimated) rows",
    )
    spark_warmup: bool = Field(
        default=True, description="start each worker's SparkSession and its Python workers "
        "when the worker starts",
    )
    spark_nice: int = Field(
        default=10, ge=0, le=19,
        description="the nice value of the worker's Spark JVM (started in the background "
        "by the warm-up): its start and its work yield CPU to the live streams; 0 keeps "
        "the worker's own",
    )
    celery_queue: str = Field(
        default="pgsieve", min_length=1, max_length=200,
        description="the Celery queue pgsieve's tasks go to and its workers consume",
    )
    consume_cycle_seconds: float = Field(
        default=60.0, gt=0, le=3600,
        description="how long one consume cycle streams before it re-enqueues itself",
    )
    consumer_lease_seconds: float = Field(
        default=30.0, gt=0, le=3600,
        description="a consumer lock whose heartbeat is older than this may be taken over",
    )
    consumer_heartbeat_seconds: float = Field(
        default=2.0, gt=0, le=600,
        description="how often a worker renews all its consumer locks (one write)",
    )
    consumer_takeover_seconds: float = Field(
        default=4.0, gt=0, le=3600,
        description="a consumer lock not renewed for this long is tried by other workers "
        "(they take it only if its holder's advisory lock on the source is gone)",
    )
    scheduler_threads: int = Field(
        default=2, ge=1, le=64,
        description="turns a worker process runs at once (its subscriptions take turns), "
        "at least: it runs one more per scheduler_subscriptions_per_thread it holds",
    )
    scheduler_subscriptions_per_thread: int = Field(
        default=32, ge=1,
        description="a worker runs one turn at once per this many subscriptions it holds "
        "(at least scheduler_threads, at most scheduler_max_threads): a turn mostly waits "
        "on its target, and 250 subscriptions two at a time lagged 9.6 s at p99",
    )
    scheduler_max_threads: int = Field(
        default=12, ge=1, le=64,
        description="turns a worker process runs at once, at most",
    )
    turn_order: Literal["oldest-commit", "arrival"] = Field(
        default="oldest-commit",
        description="which due turn a worker runs first: the stream whose waiting "
        "transaction committed first (as the server's push shows it), or the one due first",
    )
    shared_shadow_rate: float = Field(
        default=0.01, ge=0.0, le=1.0,
        description="shared decoding: the fraction of routed changes whose fast-path "
        "decisions PostgreSQL checks again (a difference stops the group with "
        "routing_divergence)",
    )
    shared_shadow_unrouted: int = Field(
        default=16, ge=0,
        description="shared decoding: of the subscriptions a sampled row was not routed "
        "to, how many the shadow check asks PostgreSQL about (every one it was routed to "
        "is asked)",
    )
    shared_detach_bytes: int = Field(
        default=1 << 30, ge=0,
        description="shared decoding: a member not reading (target down, disabled) is "
        "given a slot of its own once the others are this much WAL ahead of it",
    )
    turn_window_bytes: int = Field(
        default=16 << 20, ge=64 << 10,
        description="WAL one subscription's turn reads at most (grows for a transaction "
        "that does not fit)",
    )
    turn_max_window_bytes: int = Field(
        default=256 << 20, ge=64 << 10,
        description="on a backlog, windows double from PGSIEVE_TURN_WINDOW_BYTES up to "
        "this much WAL (each decodes again from the slot's restart_lsn); a turn reads part "
        "of a larger window and the next turn goes on with it",
    )
    turn_split_bytes: int = Field(
        default=32 << 20, ge=0,
        description="a turn's SQL window of at least this much WAL is decoded by two "
        "backends (the second part by a temporary copy of the slot, read after the "
        "first); 0: one backend",
    )
    turn_seconds: float = Field(
        default=1.0, gt=0, le=600, description="reading time of one turn at most",
    )
    merge_behind_changes: int = Field(
        default=50_000, ge=0,
        description="a turn reading a backlog closes its batch at this many changes and "
        "merges it at the target in a thread (on a second target connection) while it "
        "reads on; 0: every batch merges before the turn goes on",
    )
    push_max_backlog_bytes: int = Field(
        default=64 << 20, ge=1 << 20,
        description="transport auto: a held-open replication session reads a stream "
        "within this much WAL of the source; one further behind is read in SQL windows",
    )
    read_ahead_min_bytes: int = Field(
        default=64 << 20, ge=0,
        description="a stream at least this far behind when its SQL windows open is read "
        "by a second process, ahead of the apply (0: never)",
    )
    read_ahead_processes: int = Field(
        default=0, ge=0, le=64,
        description="read-ahead processes a worker process runs at most (0: none; streams "
        "past that read their windows themselves). Off by default: on a 2-core host shared "
        "with both databases the second process costs more CPU than its overlap saves "
        "(ADR 0021); a worker host with cores to spare gains from it",
    )
    read_ahead_buffer_bytes: int = Field(
        default=128 << 20, ge=1 << 20,
        description="decoded output a read-ahead process holds for the apply at most",
    )
    idle_poll_seconds: float = Field(
        default=0.5, gt=0, le=60,
        description="how soon a subscription whose turn found nothing looks again",
    )
    scheduler_sweep_seconds: float = Field(
        default=2.0, gt=0, le=600,
        description="how often each worker adopts enabled subscriptions nobody holds",
    )
    restart_pipelines_seconds: float = Field(
        default=15.0, gt=0, le=3600,
        description="how often beat looks for pipelines whose consumer died",
    )
    log_level: str = "INFO"
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="json: one JSON object per log line (time, level, logger, message, "
                    "request_id while serving a request), for a log pipeline",
    )

    @field_validator("allowed_hosts", "dsn_allow")
    @classmethod
    def _readable_policy(cls, value: str, info: ValidationInfo) -> str:
        # Refuse an unreadable list when the process starts, not at the first request.
        if info.field_name == "allowed_hosts":
            ConnectionPolicy.parse(value)
        else:
            ConnectionPolicy.parse("", value)
        return value

    # -- derived values -----------------------------------------------------------------
    def connection_policy(self) -> ConnectionPolicy:
        """``allowed_hosts`` and ``dsn_allow`` as a policy (ValueError when unreadable)."""
        return ConnectionPolicy.parse(self.allowed_hosts, self.dsn_allow, self.connect_timeout)

    @property
    def state_dir(self) -> Path:
        return self.home.absolute()

    @property
    def consumer_lease(self) -> timedelta:
        """``PGSIEVE_CONSUMER_LEASE_SECONDS`` as a period: a consumer lock (or a sync job)
        whose heartbeat is older is gone (the one rule:
        :func:`pgsieve.platform.locks.consumer_alive`). Callers pass it explicitly: no
        function has a default lease, which a forgotten argument would silently get."""
        return timedelta(seconds=self.consumer_lease_seconds)

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.state_dir / 'pgsieve.db'}"

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or "filesystem://"

    @property
    def broker_folder(self) -> Path:
        return self.state_dir / "broker"

    def effective_api_token(self) -> str:
        if self.api_token is not None:
            return self.api_token.get_secret_value()
        return _generated_secret(self.state_dir / "api-token")

    def effective_secret_key(self) -> str:
        if self.secret_key is not None:
            return self.secret_key.get_secret_value()
        return _generated_secret(self.state_dir / "secret-key")

    def previous_secret_keys(self) -> list[str]:
        if self.secret_key_previous is None:
            return []
        return [k.strip() for k in self.secret_key_previous.get_secret_value().split(",")
                if k.strip()]

    def secret_box(self) -> SecretBox:
        """Encrypts with PGSIEVE_SECRET_KEY; decrypts with it and the previous keys (and
        the keys of earlier versions until ``pgsieve secrets rotate``). Reads the
        deployment's salt from the metadata store (:mod:`.keyring`)."""
        return credential_box(self)

    def secret_problems(self) -> list[str]:
        """Why these settings must not serve production (empty: they may). The demo
        (PGSIEVE_DEMO, set by `pgsieve run`) uses secrets generated in PGSIEVE_HOME."""
        if self.demo:
            return []
        problems = []
        for env, value in (("PGSIEVE_API_TOKEN", self.api_token),
                           ("PGSIEVE_SECRET_KEY", self.secret_key)):
            text = value.get_secret_value().strip() if value is not None else ""
            if not text:
                problems.append(f"{env} is not set")
            elif text.lower() in WEAK_SECRETS:
                problems.append(f"{env} is a placeholder, not a secret")
            elif len(text) < MIN_SECRET_LENGTH:
                problems.append(f"{env} is shorter than {MIN_SECRET_LENGTH} characters")
        if (self.api_token is not None and self.secret_key is not None
                and self.api_token.get_secret_value() == self.secret_key.get_secret_value()):
            problems.append("PGSIEVE_API_TOKEN and PGSIEVE_SECRET_KEY are the same value")
        return problems


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) readable by this user only (0700)."""
    if not path.exists():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            path.chmod(0o700)  # whatever the umask
    return path


def _generated_secret(path: Path) -> str:
    """Read a secret kept in the state directory, creating it (mode 0600) the first time."""
    if path.exists():
        return path.read_text().strip()
    private_dir(path.parent)
    value = secrets.token_urlsafe(32)
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.touch(mode=0o600)
    tmp.write_text(value)
    # Two processes starting at once: link() is atomic and refuses to replace, so the
    # first one wins and the other reads the winner's value.
    with contextlib.suppress(FileExistsError):
        os.link(tmp, path)
    tmp.unlink(missing_ok=True)
    return path.read_text().strip()


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
