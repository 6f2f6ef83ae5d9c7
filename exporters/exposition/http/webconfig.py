"""The web configuration file of ``--web-config-file``: Prometheus exporter-toolkit's format,
the file node_exporter and dcgm-exporter take as ``--web.config.file``. It asks for TLS
(optionally with client certificates), HTTP basic auth against bcrypt hashes, and a few
response headers; this module reads it into a :class:`WebConfig` — an ``ssl.SSLContext``, a
:class:`BasicAuth` and the headers — which the exposition server is built with.

The format is https://github.com/prometheus/exporter-toolkit/blob/master/docs/web-configuration.md
and it is read as strictly as exporter-toolkit reads it: an unknown key, a key given twice, a
wrong type, an unknown ``client_auth_type`` or TLS version, a header exporter-toolkit does not
let a file set, a certificate or key that does not load, a hash that is not bcrypt — each is a
:class:`ConfigError` of one line (exit code 2 at start). Relative paths are relative to the
file's directory, as there.

Where the agent differs, and why:

* The keys of the format that the agent does not implement (inline ``cert``/``key``,
  ``cipher_suites``, ``curve_preferences``, ``client_allowed_sans``, ``rate_limit``) are an
  error when set instead of being ignored: each narrows who may connect or how, and ignoring it
  would let in what the file means to keep out. ``http_server_config.http2`` is accepted and
  ignored: the agent speaks HTTP/1.1 only.
* ``client_auth_type`` maps onto OpenSSL's three modes (:data:`CLIENT_AUTH`).
  ``RequireAnyClientCert`` is approximated: OpenSSL cannot require a certificate without
  verifying it, so here it must also chain to the client CA — stricter than exporter-toolkit,
  which takes any certificate. ``RequestClientCert`` does not ask for one at all: Go asks and
  never checks it, and nothing in the agent reads a certificate, so the same clients get in.
* Verifying client certificates needs ``client_ca_file`` (or ``client_ca``); Go would fall
  back to the system's CAs, which is rarely what a sidecar means.
* exporter-toolkit reads the file on every request and handshake; the agent reads it at start
  and again on SIGHUP (certificates, client CA, users and headers take effect for the next
  connection or request; switching TLS on or off needs a restart, as it does there).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import logging
import os
import re
import ssl
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import bcrypt
import yaml

from mrc_agent.exporters.exposition.http import Authenticator
from mrc_agent.exporters.files import describe, read_bounded
from mrc_agent.exporters.plainyaml import PlainLoader, load_yaml_mapping
from mrc_agent.exporters.settings import ConfigError, shown

log = logging.getLogger(__name__)

#: A PEM file holds a few certificates (the file itself is read with the config file's bound).
MAX_PEM_BYTES = 1 << 20

_TOP = ("tls_server_config", "http_server_config", "basic_auth_users")
_TLS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "client_ca",
        "min_version", "max_version", "prefer_server_cipher_suites")
_HTTP = ("http2", "headers")
#: Keys of the format the agent does not implement, and what to do instead.
_UNSUPPORTED = {
    "rate_limit": "put a rate limit in front of the agent",
    "cert": "give the certificate as cert_file",
    "key": "give the key as key_file",
    "cipher_suites": "OpenSSL's defaults apply",
    "curve_preferences": "OpenSSL's defaults apply",
    "client_allowed_sans": "issue client certificates from a CA of their own",
}

#: exporter-toolkit's ``client_auth_type`` (Go's ``tls.ClientAuthType``) as OpenSSL serves it.
CLIENT_AUTH: dict[str, ssl.VerifyMode] = {
    "NoClientCert": ssl.CERT_NONE,
    # Go asks for a certificate and never checks it; nothing here reads one, so not asking
    # lets in exactly the clients Go lets in.
    "RequestClientCert": ssl.CERT_NONE,
    # Approximated: Go requires a certificate without verifying it; OpenSSL cannot, so the
    # certificate must also chain to the client CA (stricter than exporter-toolkit).
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "RequireClientCert": ssl.CERT_REQUIRED,  # exporter-toolkit's older name for the above
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
#: The response headers exporter-toolkit lets a file set, and the values it takes (None: any).
HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
#: $2a$, $2b$ or $2y$ (htpasswd's), a cost of 4-31, 22 characters of salt and 31 of hash.
_BCRYPT = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
#: bcrypt reads at most this many bytes of a password; longer ones are cut, as every bcrypt
#: (Go's, htpasswd's) cuts them.
BCRYPT_MAX_PASSWORD = 72
#: Checked for a user who does not exist when no user is configured at all (with users, the
#: costliest configured hash is checked instead). A cost-10 hash of a random password nobody
#: kept.
_DECOY = b"$2b$10$NUiNa9zajcDgWW0ouxdNm.MXUDvgeBaa2l.fxEdqzgcohdge2DbJG"
#: Successful checks remembered: a few scrapers and people, each with one password.
MAX_CACHED = 64
#: Durations of recent checks at the costliest hash that set the failure floor: the slowest
#: of them, so that a padded answer is as slow as all but the rarest unpadded one.
_FLOOR_SAMPLES = 8
#: A floor older than this is measured again (one extra check of the costliest hash, at most
#: once a minute), so it follows the machine's load.
_FLOOR_REFRESH_S = 60.0


def _cost(hashed: bytes) -> int:
    """The cost of a bcrypt hash (``$2b$12$...`` → 12); the pattern was checked on load."""
    return int(hashed[4:6])


class BasicAuth(Authenticator):
    """HTTP basic auth against bcrypt hashes.

    A bcrypt check costs tens of milliseconds by design, too much for every 1 s scrape, so a
    (user, password) pair that passed once is remembered — as exporter-toolkit does — under
    an HMAC with a key of this process's, never in the clear. Failures are not remembered:
    each costs a check, which the server runs in a thread of its own.

    A wrong password must not tell users apart by its answer's time. A bcrypt check takes
    time in proportion to 2^cost, so an unknown user is checked against the costliest
    configured hash (its answer ignored), and :meth:`failure_floor_s` gives the server the
    time a check of that hash has taken lately: it answers no failure sooner, so a cost-5
    user's wrong password takes as long as a cost-12 user's or a stranger's. What stays
    unequal: a correct password is answered when its own check ends (a cheap hash sooner —
    the answer says it passed anyway), a remembered one at once, an ``Authorization`` that is
    not basic auth at all at once, and the wait in the server's queue depends on the load.
    """

    def __init__(self, users: Mapping[str, str]) -> None:
        self._users = {u.encode(): h.encode() for u, h in users.items()}
        self._decoy = max(self._users.values(), key=_cost, default=_DECOY)
        self._top = _cost(self._decoy)
        self._key = os.urandom(32)
        self._passed: dict[bytes, None] = {}  # insertion order: the oldest goes first
        self._lock = threading.Lock()
        self._took: deque[float] = deque(maxlen=_FLOOR_SAMPLES)
        self._measured: float | None = None  # monotonic time of the last costliest check

    def _digest(self, user: bytes, password: bytes) -> bytes:
        msg = len(user).to_bytes(4, "big") + user + password
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def cached(self, authorization: str | None) -> bool | None:
        creds = credentials(authorization)
        if creds is None:
            return False
        return True if self._digest(*creds) in self._passed else None

    def check(self, authorization: str | None) -> bool:
        creds = credentials(authorization)
        if creds is None:
            return False
        user, password = creds
        digest = self._digest(user, password)
        if digest in self._passed:
            return True
        hashed = self._users.get(user)
        target = self._decoy if hashed is None else hashed
        try:
            ok = self._checkpw(password[:BCRYPT_MAX_PASSWORD], target)
        except ValueError as exc:  # a hash that passed the pattern but not bcrypt itself
            log.warning("basic auth: the hash of user %r does not check: %s",
                        user if hashed is not None else self._decoy_user(), exc)
            return False
        if not ok or hashed is None:
            measured = self._measured
            if measured is None or time.monotonic() - measured > _FLOOR_REFRESH_S:
                # No recent check of the costliest hash to set the floor: time one now. A
                # broken hash is logged where its own user's checks fail.
                with contextlib.suppress(ValueError):
                    self._checkpw(b"", self._decoy)
            return False
        with self._lock:
            self._passed[digest] = None
            while len(self._passed) > MAX_CACHED:
                del self._passed[next(iter(self._passed))]
        return True

    def _checkpw(self, password: bytes, hashed: bytes) -> bool:
        """bcrypt's check, timed when it is one of the costliest hash."""
        started = time.monotonic()
        ok = bcrypt.checkpw(password, hashed)
        if _cost(hashed) >= self._top:
            now = time.monotonic()
            with self._lock:
                self._took.append(now - started)
                self._measured = now
        return ok

    def _decoy_user(self) -> bytes:
        return next((u for u, h in self._users.items() if h == self._decoy), b"")

    def failure_floor_s(self) -> float:
        """The least time from the start of a failed check to its answer: the slowest recent
        check of the costliest configured hash (0 before any)."""
        with self._lock:
            return max(self._took, default=0.0)


def credentials(authorization: str | None) -> tuple[bytes, bytes] | None:
    """(user, password) of an ``Authorization: Basic ...`` header; None for anything else."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        raw = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = raw.partition(b":")
    return (user, password) if sep else None


@dataclass(frozen=True)
class WebConfig:
    """What the web configuration file asks of the HTTP server (nothing without a file)."""

    path: str | None = None
    tls: ssl.SSLContext | None = None
    client_auth: str = "NoClientCert"
    users: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    auth: BasicAuth | None = None

    def summary(self) -> str:
        """One phrase for the log: what is on."""
        parts = [f"TLS (client certificates: {self.client_auth})" if self.tls else "no TLS",
                 f"basic auth for {len(self.users)} user(s)" if self.users else "no basic auth"]
        if self.headers:
            parts.append("headers " + ", ".join(self.headers))
        return ", ".join(parts)


def load_web_config(path: str | None) -> WebConfig:
    """The web configuration in ``path`` (an empty one for None), checked and built."""
    if not path:
        return WebConfig()
    where = f"web config file {path}"
    data = load_yaml_mapping(path, "web config file", "a mapping (tls_server_config, "
                             "http_server_config, basic_auth_users)", _StrictLoader)
    _keys(data, _TOP, where, "")
    base = os.path.dirname(path)
    tls, client_auth = _tls_context(_section(data, "tls_server_config", where), base, where)
    headers = _headers(_section(data, "http_server_config", where), where)
    users = _users(data.get("basic_auth_users"), where)
    return WebConfig(path, tls, client_auth, users, headers, BasicAuth(users) if users else None)


def reload_web_config(running: WebConfig, path: str | None) -> WebConfig:
    """The web configuration to switch to on SIGHUP. Raises ConfigError for a bad file or one
    that would switch TLS on or off (that needs a restart: scrapers change scheme). Keeps the
    running authenticator, and the checks it remembers, when the users are the same."""
    new = load_web_config(path)
    if (new.tls is None) != (running.tls is None):
        origin = f"web config file {path}" if path else "without a web config file"
        raise ConfigError(f"{origin}: switching TLS {'on' if new.tls else 'off'} needs a "
                          "restart")
    if running.auth is not None and dict(new.users) == dict(running.users):
        new = replace(new, auth=running.auth)
    return new


# -- reading -----------------------------------------------------------------------------------

class _StrictLoader(PlainLoader):
    """The config file's loader (plain data, no anchors or aliases) that also refuses a key
    given twice, as exporter-toolkit's strict unmarshalling does (the last of two users of one
    name must not win silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        try:
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {shown(key)} given twice", key_node.start_mark)
            seen.add(key)
        except TypeError:  # an unhashable key: construct_mapping says so
            break
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                              _construct_mapping)


def _keys(section: Mapping[Any, Any], known: tuple[str, ...], where: str, prefix: str) -> None:
    for key, value in section.items():
        if key in known:
            continue
        name = f"{prefix}{key if isinstance(key, str) else shown(key)}"
        if key in _UNSUPPORTED:
            if value in (None, "", [], {}):
                continue  # set to nothing: means what leaving it out means
            raise ConfigError(f"{where}: {name} is not supported by mrc-agent "
                              f"({_UNSUPPORTED[key]})")
        raise ConfigError(f"{where}: unknown key {shown(name)} (known: {', '.join(known)})")


def _section(data: Mapping[str, Any], name: str, where: str) -> dict[str, Any]:
    section = data.get(name)
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: {name} must be a mapping")
    return section


def _string(section: Mapping[str, Any], key: str, where: str, prefix: str) -> str:
    value = section.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {prefix}{key} must be a string, not {shown(value)}")
    return value


def _flag(section: Mapping[str, Any], key: str, default: bool, where: str, prefix: str) -> bool:
    value = section.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {prefix}{key} must be true or false, not "
                          f"{shown(value)}")
    return value


# -- TLS ---------------------------------------------------------------------------------------

class _Encrypted(Exception):
    """The key file asks for a passphrase (never prompt for one on a terminal)."""


def _no_passphrase() -> str:
    raise _Encrypted


def _ssl_reason(exc: Exception) -> str:
    """OpenSSL's reason without the library tag and the C source line."""
    text = str(exc.args[1] if isinstance(exc, OSError) and len(exc.args) > 1 else exc)
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return re.sub(r"\s*\(_ssl\.c:\d+\)$", "", text)


def _pem(path: str, what: str, marker: bytes, where: str) -> bytes:
    try:
        data = read_bounded(path, MAX_PEM_BYTES, what)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {what} {path}: {describe(exc)}") from exc
    if marker not in data:
        kind = "private key" if marker.startswith(b"PRIVATE") else "certificate"
        raise ConfigError(f"{where}: {what} {path} holds no PEM {kind}")
    return data


def _tls_context(section: Mapping[str, Any], base: str,
                 where: str) -> tuple[ssl.SSLContext | None, str]:
    prefix = "tls_server_config."
    _keys(section, _TLS, where, prefix)

    def path(key: str) -> str:
        value = _string(section, key, where, prefix)
        return os.path.join(base, value) if value else ""

    cert, key, ca_file = path("cert_file"), path("key_file"), path("client_ca_file")
    ca_text = _string(section, "client_ca", where, prefix)
    auth_name = _string(section, "client_auth_type", where, prefix) or "NoClientCert"
    # TLS is on when any of its settings is (exporter-toolkit's TLSConfig.IsEnabled).
    if not (cert or key or ca_file or ca_text or section.get("client_auth_type")):
        return None, "NoClientCert"
    if not cert:
        raise ConfigError(f"{where}: {prefix}cert_file is missing")
    if not key:
        raise ConfigError(f"{where}: {prefix}key_file is missing")
    mode = CLIENT_AUTH.get(auth_name)
    if mode is None:
        raise ConfigError(f"{where}: {prefix}client_auth_type {shown(auth_name)} is not one of "
                          f"{', '.join(CLIENT_AUTH)}")
    if ca_file and ca_text:
        raise ConfigError(f"{where}: give {prefix}client_ca_file or client_ca, not both")
    if (ca_file or ca_text) and auth_name == "NoClientCert":
        raise ConfigError(f"{where}: a client CA is given but client_auth_type is "
                          "NoClientCert")
    if mode != ssl.CERT_NONE and not (ca_file or ca_text):
        raise ConfigError(f"{where}: client_auth_type {auth_name} needs {prefix}client_ca_file,"
                          " the CA that signs the client certificates")
    versions = []
    for name, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        text = _string(section, name, where, prefix) or default
        if text not in TLS_VERSIONS:
            raise ConfigError(f"{where}: {prefix}{name} {shown(text)} is not one of "
                              f"{', '.join(TLS_VERSIONS)}")
        versions.append(TLS_VERSIONS[text])
    if versions[0] > versions[1]:
        raise ConfigError(f"{where}: {prefix}min_version is above max_version")

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version, ctx.maximum_version = versions
    if not _flag(section, "prefer_server_cipher_suites", True, where, prefix):
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    _pem(cert, "cert_file", b"-----BEGIN CERTIFICATE-----", where)
    _pem(key, "key_file", b"PRIVATE KEY-----", where)
    try:
        ctx.load_cert_chain(cert, key, password=_no_passphrase)
    except _Encrypted:
        raise ConfigError(f"{where}: key_file {key} is encrypted; give it unencrypted (as "
                          "exporter-toolkit needs it)") from None
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"{where}: cert_file {cert} and key_file {key} do not load: "
                          f"{_ssl_reason(exc)}") from exc
    if ca_file or ca_text:
        origin = f"client_ca_file {ca_file}" if ca_file else "client_ca"
        pem = _pem(ca_file, "client_ca_file", b"-----BEGIN CERTIFICATE-----", where) \
            if ca_file else ca_text.encode()
        if b"-----BEGIN CERTIFICATE-----" not in pem:
            raise ConfigError(f"{where}: {origin} holds no PEM certificate")
        try:
            ctx.load_verify_locations(cadata=pem.decode("ascii"))
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"{where}: {origin} does not load: {_ssl_reason(exc)}") from exc
    ctx.verify_mode = mode
    return ctx, auth_name


# -- HTTP --------------------------------------------------------------------------------------

def _headers(section: Mapping[str, Any], where: str) -> dict[str, str]:
    prefix = "http_server_config."
    _keys(section, _HTTP, where, prefix)
    _flag(section, "http2", True, where, prefix)  # checked, then ignored: HTTP/1.1 only here
    given = section.get("headers")
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise ConfigError(f"{where}: {prefix}headers must be a mapping")
    out = {}
    for name, value in given.items():
        if name not in HEADERS:
            raise ConfigError(f"{where}: header {shown(name)} cannot be set (exporter-toolkit lets "
                              f"a file set {', '.join(HEADERS)})")
        if value is None or value == "":
            continue  # "unset if blank"
        if not isinstance(value, str) or not value.isprintable() or not value.isascii():
            raise ConfigError(f"{where}: header {name} must be one line of ASCII text")
        allowed = HEADERS[name]
        if allowed is not None and value not in allowed:
            raise ConfigError(f"{where}: header {name} {shown(value)} is not one of "
                              f"{', '.join(allowed)}")
        out[name] = value
    return out


def _users(given: Any, where: str) -> dict[str, str]:
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise ConfigError(f"{where}: basic_auth_users must map user names to bcrypt hashes")
    for user, hashed in given.items():
        if not isinstance(user, str):
            raise ConfigError(f"{where}: basic_auth_users: user name {shown(user)} must be a "
                              "string (quote it)")
        if not isinstance(hashed, str) or not _BCRYPT.fullmatch(hashed):
            raise ConfigError(f"{where}: basic_auth_users: the password of {shown(user)} is "
                              "not a bcrypt hash (make one with: htpasswd -nBC 10 \"\" | "
                              "tr -d ':\\n')")
    return dict(given)
