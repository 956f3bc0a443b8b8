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
        raise InvalidDsn(f"not a valid PostgreSQL connection string: {_dsn_problem(exc)}"
                         ) from None
    return {k: str(v) for k, v in params.items() if v is not None}


# libpq's parse errors quote the text around the mistake ('missing "=" after "hunter2"'),
# which can be a piece of the password: say what kind of mistake it is, never the text.
_DSN_PROBLEMS = (
    ("invalid connection option", "an unknown parameter name"),
    ('missing "="', "a parameter without '=' and a value"),
    ("unterminated quoted string", "an unterminated quoted value"),
    ("invalid URI", "a malformed URI"),
    ("invalid percent-encoded", "a malformed percent-encoding"),
    ("forbidden value %00", "a NUL character"),
    ("unexpected spaces", "spaces inside an IPv6 host"),
    ("end of string reached when looking for matching", "an unclosed IPv6 bracket"),
    ("unexpected character", "an unexpected character"),
    ("invalid integer value", "a parameter that must be a number"),
)


def _dsn_problem(exc: Exception) -> str:
    text = str(exc)
    for marker, kind in _DSN_PROBLEMS:
        if marker in text:
            return f"{kind} (libpq URI or key=value pairs)"
    return "expected a libpq URI (postgresql://…) or key=value pairs"


#: DSN parameters that hold secrets (libpq's "password" and the client key's passphrase).
SECRET_KEYS = frozenset({"password", "sslpassword"})


def mask_dsn(dsn: str) -> str:
    """The DSN with every secret replaced by ``********``, in the form it was given.

    Secrets are the URI's userinfo password and the ``password``/``sslpassword``
    parameters, however spelled (``?%70assword=``, ``PASSWORD``). The result is checked by
    parsing it back; when any secret survives, a rebuilt key=value string is returned.
    """
    params = parse_dsn(dsn)
    text = dsn.strip()
    if not SECRET_KEYS & params.keys() and not _uri_password(text):
        return text
    masked = _scrub(text)
    with contextlib.suppress(InvalidDsn):
        again = parse_dsn(masked)
        if all(again.get(k) == MASK for k in SECRET_KEYS & params.keys()) \
                and again.keys() == params.keys():
            return masked
    for key in SECRET_KEYS & params.keys():
        params[key] = MASK
    return make_conninfo(**params)


def _uri_password(text: str) -> bool:
    if not text.startswith(("postgresql://", "postgres://")):
        return False
    netloc = urlsplit(text).netloc
    return "@" in netloc and ":" in netloc.rsplit("@", 1)[0]


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
#: per process and key: derivations are cached).
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
#: The salt of pgsieve from 0007 to 0008: the same in every deployment, so one guess at a
#: weak PGSIEVE_SECRET_KEY served every stolen store. Since 0009 each deployment has its
#: own (``installation.kdf_salt``, made by the migration); this one only decrypts, until
#: ``pgsieve secrets rotate``.
FIXED_SALT = b"pgsieve-credentials-v2"


@functools.lru_cache(maxsize=16)
def derive_key(secret_key: str, salt: bytes = FIXED_SALT) -> bytes:
    """The Fernet key for ``secret_key``: scrypt (memory-hard), so a weak secret is slow
    to guess from a stolen metadata store, with this deployment's ``salt``."""
    raw = Scrypt(salt=salt, length=32, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P).derive(
        secret_key.encode())
    return base64.urlsafe_b64encode(raw)


def legacy_key(secret_key: str) -> bytes:
    """The key of pgsieve before 0007 (one SHA-256): decrypts what it stored, never used
    to encrypt."""
    digest = hashlib.sha256(("pgsieve-credentials:" + secret_key).encode()).digest()
    return base64.urlsafe_b64encode(digest)


class SecretBox:
    """Symmetric encryption of credentials (Fernet: AES-128-CBC + HMAC-SHA256) with a key
    derived from ``PGSIEVE_SECRET_KEY`` by scrypt with the deployment's ``salt``.

    Decryption also accepts the keys of ``previous`` secret keys (rotation) and, while
    ``legacy`` (until ``pgsieve secrets rotate`` re-encrypted everything), the keys of
    earlier versions: scrypt with :data:`FIXED_SALT`, and one SHA-256 before that.
    Encryption always uses the current key. :meth:`rotate` re-encrypts a token with it.
    """

    def __init__(self, secret_key: str, previous: Sequence[str] = (), *,
                 salt: bytes = FIXED_SALT, legacy: bool = True) -> None:
        olds = [old for old in previous if old and old != secret_key]
        keys = [derive_key(secret_key, salt), *(derive_key(old, salt) for old in olds)]
        if legacy:
            if salt != FIXED_SALT:
                keys += [derive_key(k) for k in (secret_key, *olds)]
            keys += [legacy_key(k) for k in (secret_key, *olds)]
        self.legacy = legacy
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


def _key_pattern(word: str) -> str:
    """``word`` with any of its letters possibly percent-encoded (``%70assword``)."""
    return "".join(f"(?:{re.escape(c)}|%{ord(c):02x})" for c in word)


# Where a secret may start: a URI's "://" (its userinfo may hold a password), a password
# parameter's "=" (key=value, a URI query, the PGPASSWORD environment variable), or a
# quoted password key's ":" (a Python dict's repr, JSON). Possessive quantifiers: the
# pattern never backtracks, so finding every anchor is one pass over the text.
_ANCHOR = re.compile(
    r"://|(?<![a-z0-9_%])(?:pg)?(?:" + _key_pattern("ssl") + ")?" + _key_pattern("password")
    + r"\s*+=\s*+|(?P<quote>['\"])(?:ssl)?password(?P=quote)\s*+:\s*+",
    re.IGNORECASE,
)
_SCHEME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+.-")
_AUTHORITY_END = re.compile(r"[/?#\s]")
_VALUE_END = re.compile(r"\s")
_QUERY_VALUE_END = re.compile(r"[\s&#]")


class _Cost:
    """Characters examined by the last :func:`_scrub` (tests bound it: linear, not n²)."""

    chars = 0


def _scrub(text: str) -> str:
    """Mask passwords in free text (log lines, error messages) in one linear pass.

    The old pair of regular expressions backtracked over every ``scheme://`` without an
    ``@`` and every unterminated ``password='``: quadratic (0.37 s for 8 KB). Here each
    anchor's scan ends where the next one can begin, so the text is read a bounded number
    of times.
    """
    out: list[str] = []
    pos = 0  # everything before pos is already in out
    cost = 0
    for m in _ANCHOR.finditer(text):
        start, end = m.span()
        if start < pos:
            continue
        if m.group(0) == "://":
            # the scheme: letters just before "://" (looked at, at most 32 of them)
            lo = start
            while lo > 0 and start - lo < 32 and text[lo - 1] in _SCHEME_CHARS:
                lo -= 1
            cost += start - lo
            if lo == start or not text[lo].isalpha():
                continue
            stop = _AUTHORITY_END.search(text, end)
            auth_end = stop.start() if stop else len(text)
            cost += auth_end - end
            at = text.rfind("@", end, auth_end)
            if at < 0:
                continue
            colon = text.find(":", end, at)
            if colon < 0:
                continue
            out.append(text[pos:colon + 1])
            out.append(MASK)
            pos = at
            continue
        # a password parameter: the value is quoted ('…' or "…", with \ escapes) or a
        # bare word
        if end < len(text) and text[end] in "'\"":
            quote = text[end]
            i = end + 1
            while i < len(text):
                c = text[i]
                if c == "\\":
                    i += 2
                    continue
                if c == quote:
                    i += 1
                    break
                i += 1
            value_end = min(i, len(text))
        else:
            # "&" ends a value only in a URI query (?password=…&…); in key=value text it
            # may be part of the password
            in_query = start > 0 and text[start - 1] in "?&"
            stop = (_QUERY_VALUE_END if in_query else _VALUE_END).search(text, end)
            value_end = stop.start() if stop else len(text)
        cost += value_end - end
        if value_end == end:
            continue
        out.append(text[pos:end])
        out.append(MASK)
        pos = value_end
    out.append(text[pos:])
    _Cost.chars = cost + len(text)
    return "".join(out)


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
