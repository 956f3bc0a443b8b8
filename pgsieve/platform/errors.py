"""Domain errors with stable codes.

Every error a user can cause is a :class:`PgsieveError` carrying a stable ``code`` (the
contract automation relies on), an HTTP status and a human message. The API renders it as
RFC 9457 problem+json; the CLI prints it. Messages never contain secrets.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import psycopg


class ErrorCode(StrEnum):
    """Every stable ``code`` pgsieve answers with: problem+json ``code`` of the HTTP API and
    a failed job's ``error_code``. Part of the contract: values never change once
    released; add members instead. docs/api.md's error tables list exactly these
    (tests/test_docs.py); row-filter problems inside ``errors[]`` are
    :class:`pgsieve.rowfilter.IssueCode`.
    """

    ALERT_CHANNEL_IN_USE = "alert_channel_in_use"
    ALERT_CHANNEL_NOT_FOUND = "alert_channel_not_found"
    ALERT_RULE_NOT_FOUND = "alert_rule_not_found"
    AUDIT_UNAVAILABLE = "audit_unavailable"
    BAD_REQUEST = "bad_request"
    COLUMN_LIST_NOT_COVERING_REPLICA_IDENTITY = "column_list_not_covering_replica_identity"
    COLUMN_NOT_PUBLISHED = "column_not_published"
    CONFLICT = "conflict"
    CONFLICTING_PATCH_FIELDS = "conflicting_patch_fields"
    CONNECTION_NOT_ALLOWED = "connection_not_allowed"
    DIFF_NEEDS_KEY = "diff_needs_key"
    DUPLICATE_NAME = "duplicate_name"
    DUPLICATE_SCHEMA = "duplicate_schema"
    DUPLICATE_TABLE = "duplicate_table"
    FILTER_COLUMN_NOT_IN_REPLICA_IDENTITY = "filter_column_not_in_replica_identity"
    FILTER_EVALUATION_ERROR = "filter_evaluation_error"
    FILTER_NOT_ALLOWED_FOR_PUBLICATION_KIND = "filter_not_allowed_for_publication_kind"
    FORBIDDEN = "forbidden"
    HTTP_ERROR = "http_error"
    INDEX_REBUILD_FAILED = "index_rebuild_failed"
    INVALID_CURSOR = "invalid_cursor"
    INVALID_DSN = "invalid_dsn"
    INVALID_LSN = "invalid_lsn"
    INVALID_PUBLICATION_KIND = "invalid_publication_kind"
    INVALID_ROLE = "invalid_role"
    INVALID_SLOT_NAME = "invalid_slot_name"
    INVALID_TABLE_NAME = "invalid_table_name"
    INVALID_TOKEN_NAME = "invalid_token_name"
    INVALID_WEBHOOK_URL = "invalid_webhook_url"
    JOB_NOT_FOUND = "job_not_found"
    MALFORMED_JSON = "malformed_json"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    NOT_ACCEPTABLE = "not_acceptable"
    NOT_FOUND = "not_found"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    PUBLICATION_ALREADY_MANAGED = "publication_already_managed"
    PUBLICATION_BUSY = "publication_busy"
    PUBLICATION_EXISTS = "publication_exists"
    PUBLICATION_IN_USE = "publication_in_use"
    PUBLICATION_NOT_FOUND = "publication_not_found"
    PUBLICATION_NOT_MANAGED = "publication_not_managed"
    PUBLICATION_REJECTED_BY_POSTGRES = "publication_rejected_by_postgres"
    ROUTING_DIVERGENCE = "routing_divergence"
    SCHEMA_CHANGE_UNSUPPORTED = "schema_change_unsupported"
    SKIP_LSN_ALREADY_APPLIED = "skip_lsn_already_applied"
    SLOT_ACTIVE = "slot_active"
    SLOT_CREATE_FAILED = "slot_create_failed"
    SLOT_EXISTS = "slot_exists"
    SLOT_IN_USE = "slot_in_use"
    SLOT_LIMIT_REACHED = "slot_limit_reached"
    SLOT_NOT_FOUND = "slot_not_found"
    SLOT_NOT_MANAGED = "slot_not_managed"
    SLOT_PLUGIN_MISMATCH = "slot_plugin_mismatch"
    SNAPSHOT_FAILED = "snapshot_failed"
    SOURCE_IN_USE = "source_in_use"
    SOURCE_NOT_FOUND = "source_not_found"
    SOURCE_TRANSACTIONS_RUNNING = "source_transactions_running"
    SOURCE_UNREACHABLE = "source_unreachable"
    SUBSCRIPTION_BUSY = "subscription_busy"
    SUBSCRIPTION_NOT_FOUND = "subscription_not_found"
    SUBSCRIPTION_SOURCE_MISMATCH = "subscription_source_mismatch"
    SYNC_FAILED = "sync_failed"
    SYNC_IN_PROGRESS = "sync_in_progress"
    TABLE_ALREADY_IN_PUBLICATION = "table_already_in_publication"
    TABLE_NOT_IN_PUBLICATION = "table_not_in_publication"
    TABLE_NOT_PUBLISHED = "table_not_published"
    TARGET_COLUMN_MISMATCH = "target_column_mismatch"
    TARGET_IN_USE = "target_in_use"
    TARGET_NOT_FOUND = "target_not_found"
    TARGET_TABLE_MISSING = "target_table_missing"
    TARGET_UNREACHABLE = "target_unreachable"
    THRESHOLD_NOT_APPLICABLE = "threshold_not_applicable"
    TOKEN_EXISTS = "token_exists"
    TOKEN_NOT_FOUND = "token_not_found"
    TOO_MANY_REQUESTS = "too_many_requests"
    UNAUTHORIZED = "unauthorized"
    UNKNOWN_ALERT_CHANNEL = "unknown_alert_channel"
    UNKNOWN_COLUMN = "unknown_column"
    UNKNOWN_SCHEMA = "unknown_schema"
    UNKNOWN_TABLE = "unknown_table"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    UNSUPPORTED_SERVER_VERSION = "unsupported_server_version"
    UNSUPPORTED_TARGET_KIND = "unsupported_target_kind"
    VALIDATION_ERROR = "validation_error"
    WAL_LEVEL_NOT_LOGICAL = "wal_level_not_logical"


class PgsieveError(Exception):
    status: int = 400
    code: str = ErrorCode.BAD_REQUEST
    title: str = "Bad request"

    def __init__(
        self,
        detail: str,
        *,
        code: str | None = None,
        status: int | None = None,
        title: str | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if title is not None:
            self.title = title
        self.extra = extra


class NotFound(PgsieveError):
    status = 404
    code = ErrorCode.NOT_FOUND
    title = "Not found"


class Conflict(PgsieveError):
    status = 409
    code = ErrorCode.CONFLICT
    title = "Conflict"


class Unprocessable(PgsieveError):
    status = 422
    code = ErrorCode.VALIDATION_ERROR
    title = "Unprocessable request"


class TooManyRequests(PgsieveError):
    """A limit on concurrent work was reached; the client may try again after
    ``retry_after`` seconds (the API sends it as ``Retry-After``)."""

    status = 429
    code = ErrorCode.TOO_MANY_REQUESTS
    title = "Too many requests"

    def __init__(self, detail: str, *, retry_after: int = 1, **extra: Any) -> None:
        super().__init__(detail, **extra)
        self.retry_after = retry_after


class Unreachable(PgsieveError):
    """A database named by the user cannot be reached (4xx: the user's DSN is at fault)."""

    status = 422
    code = ErrorCode.SOURCE_UNREACHABLE
    title = "Database unreachable"


def describe_error(error: psycopg.Error) -> str:
    """PostgreSQL's own message (primary, detail, hint), without the statement."""
    diag = error.diag
    text = diag.message_primary or str(error).strip()
    if diag.message_detail:
        text += f" — {diag.message_detail}"
    if diag.message_hint:
        text += f" (hint: {diag.message_hint})"
    return text
