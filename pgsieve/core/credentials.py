"""Connection strings: parsing, masking, and encryption at rest.

DSNs carry passwords. They are stored encrypted (Fernet, key derived from
``PGSIEVE_SECRET_KEY`` by scrypt; earlier keys still decrypt), decrypted only to connect,
and shown only masked. A logging filter masks anything that looks like a password in log
records as a second line of defence.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import logging
import re
import traceback
from collections.abc import Sequence
from urllib.parse import quote, urlsplit

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt
from psycopg.conninfo import conninfo_to_dict, make_conninfo

MASK = "********"


class InvalidDsn(ValueError):
    """The text is not a libpq connection string (URI or key=value)."""


class CredentialError(RuntimeError):
    """A stored credential could not be decrypted (wrong or rotated PGSIEVE_SECRET_KEY)."""


def parse_dsn(dsn: str) -> dict[str, str]:
    """Parse a libpq URI or key=value string into its parameters."""
    if not isinstance(dsn, str) or not dsn.strip():
        raise InvalidDsn("the DSN is empty")
    try:
        params = conninfo_to_dict(dsn)
    except Exception as exc:  # psycopg raises ProgrammingError with libpq's message
        raise InvalidDsn(f"not a valid PostgreSQL connection string: {_scrub(str(exc))}") from exc
    return {k: str(v) for k, v in params.items() if v is not None}


def mask_dsn(dsn: str) -> str:
    """The DSN with its password replaced by ``********``, in the form it was given."""
    params = parse_dsn(dsn)
    if dsn.strip().startswith(("postgresql://", "postgres://")):
        parts = urlsplit(dsn.strip())
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, hostinfo = netloc.rsplit("@", 1)
            if ":" in userinfo:
                userinfo = userinfo.split(":", 1)[0] + ":" + MASK
            netloc = f"{userinfo}@{hostinfo}"
        query = re.sub(r"(?i)(^|&)(password=)[^&]*", lambda m: m.group(1) + m.group(2) + MASK,
                       parts.query)
        masked = f"{parts.scheme}://{netloc}{parts.path}"
        return masked + (f"?{query}" if query else "")
    if "password" not in params:
        return dsn.strip()
    # Keep the user's own spelling and order; fall back to a rebuilt string if the text
    # form was unusual enough that the pattern missed the password.
    masked = _scrub(dsn.strip())
    with contextlib.suppress(InvalidDsn):
        if parse_dsn(masked).get("password") == MASK:
            return masked
    params["password"] = MASK
    return make_conninfo(**params)


def dsn_summary(dsn: str) -> dict[str, str | None]:
    """Host, port, database and user of a DSN (no password), for display."""
    params = parse_dsn(dsn)
    return {
        "host": params.get("host") or params.get("hostaddr"),
        "port": params.get("port"),
        "dbname": params.get("dbname"),
        "user": params.get("user"),
    }


def with_dbname(dsn: str, dbname: str) -> str:
    params = parse_dsn(dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)


def to_uri(dsn: str) -> str:
    """A libpq URI for the DSN (for tools that only take URIs); keeps the password."""
    p = parse_dsn(dsn)
    user = quote(p.get("user", ""), safe="")
    auth = user + (":" + quote(p["password"], safe="") if "password" in p else "")
    host = p.get("host", "127.0.0.1")
    port = f":{p['port']}" if "port" in p else ""
    return f"postgresql://{auth + '@' if auth else ''}{host}{port}/{quote(p.get('dbname', ''))}"


#: scrypt parameters for the credential key (about 16 MiB and tens of milliseconds, once
#: per process and key: derivations are cached). The salt is fixed so that every process
#: of a deployment derives the same key from PGSIEVE_SECRET_KEY alone.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
_KDF_SALT = b"pgsieve-credentials-v2"


@functools.lru_cache(maxsize=16)
def derive_key(secret_key: str) -> bytes:
    """The Fernet key for ``secret_key``: scrypt (memory-hard), so a weak secret is slow
    to guess from a stolen metadata store."""
    raw = Scrypt(salt=_KDF_SALT, length=32, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P).derive(
        secret_key.encode())
    return base64.urlsafe_b64encode(raw)


def legacy_key(secret_key: str) -> bytes:
    """The key of pgsieve before 0007 (one SHA-256): decrypts what it stored, never used
    to encrypt."""
    digest = hashlib.sha256(("pgsieve-credentials:" + secret_key).encode()).digest()
    return base64.urlsafe_b64encode(digest)


class SecretBox:
    """Symmetric encryption of credentials (Fernet: AES-128-CBC + HMAC-SHA256) with a key
    derived from ``PGSIEVE_SECRET_KEY`` by scrypt.

    Decryption also accepts the keys of ``previous`` secret keys (rotation) and the legacy
    SHA-256 derivation of every key (credentials stored before the KDF); encryption
    always uses the current key. :meth:`rotate` re-encrypts a token with the current key.
    """

    def __init__(self, secret_key: str, previous: Sequence[str] = ()) -> None:
        keys = [derive_key(secret_key)]
        for old in previous:
            if old and old != secret_key:
                keys.append(derive_key(old))
        keys.append(legacy_key(secret_key))
        keys += [legacy_key(old) for old in previous if old and old != secret_key]
        self._primary = Fernet(keys[0])
        self._fernet = MultiFernet([Fernet(k) for k in keys])

    def encrypt(self, plaintext: str) -> str:
        return self._primary.encrypt(plaintext.encode()).decode()

    def decrypt(self, token: str) -> str:
        try:
            return self._fernet.decrypt(token.encode()).decode()
        except InvalidToken as exc:
            raise CredentialError(
                "stored credentials cannot be decrypted: PGSIEVE_SECRET_KEY changed? "
                "(an earlier key goes in PGSIEVE_SECRET_KEY_PREVIOUS)"
            ) from exc

    def is_current(self, token: str) -> bool:
        """Whether ``token`` is encrypted with the current key."""
        try:
            self._primary.decrypt(token.encode())
        except InvalidToken:
            return False
        return True

    def rotate(self, token: str) -> str:
        """``token`` re-encrypted with the current key (CredentialError if no key fits)."""
        return self.encrypt(self.decrypt(token))


_PASSWORD_PATTERNS = [
    # URI userinfo: scheme://user:secret@host
    (re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)([^@\s]+)(@)", re.I), r"\1" + MASK + r"\3"),
    # key=value and query parameters
    (re.compile(r"(?i)(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]+)"), r"\1" + MASK),
]


def _scrub(text: str) -> str:
    for pattern, repl in _PASSWORD_PATTERNS:
        text = pattern.sub(repl, text)
    return text


scrub_secrets = _scrub


class SecretsFilter(logging.Filter):
    """Masks passwords in every log record that passes through a handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string must not break logging
            return True
        scrubbed = _scrub(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        if record.exc_info and record.exc_info[0] is not None:
            # A traceback repeats the exception's text: format it now, scrubbed, so the
            # handler prints this text instead of formatting the raw exception again.
            text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            record.exc_text = _scrub(text)
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = _scrub(record.exc_text)
        return True


def install_log_scrubber() -> None:
    """Attach :class:`SecretsFilter` to every handler of the root logger."""
    root = logging.getLogger()
    for handler in root.handlers:
        if not any(isinstance(f, SecretsFilter) for f in handler.filters):
            handler.addFilter(SecretsFilter())
