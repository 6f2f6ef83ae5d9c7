"""The web configuration file (``exporters/exposition/http/webconfig.py``) read without a
server: every check of the exporter-toolkit format with the exact line a user reads for a bad
file, the ``ssl.SSLContext`` it builds, the basic-auth cache and the SIGHUP rules. One
self-signed certificate per module; ``tests/integration/test_web_config.py`` speaks TLS to a
real server."""

from __future__ import annotations

import base64
import datetime
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from mrc_agent.agent.core.config import ConfigError
from mrc_agent.exporters.exposition.http import webconfig as w
from mrc_agent.exporters.exposition.http.webconfig import (
    BasicAuth,
    WebConfig,
    credentials,
    load_web_config,
    reload_web_config,
)

TLS = "tls_server_config."


@dataclass(frozen=True)
class Files:
    cert: Path
    key: Path
    other_key: Path
    encrypted_key: Path
    ca_pem: str


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    """A self-signed certificate and its key (plain and encrypted), and a key of nothing."""
    root = tmp_path_factory.mktemp("pem")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mrc-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    out = Files(root / "cert.pem", root / "key.pem", root / "other-key.pem",
                root / "encrypted-key.pem", pem.decode())
    out.cert.write_bytes(pem)

    def key_pem(k: ec.EllipticCurvePrivateKey,
                enc: serialization.KeySerializationEncryption) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               enc)

    out.key.write_bytes(key_pem(key, serialization.NoEncryption()))
    out.other_key.write_bytes(key_pem(ec.generate_private_key(ec.SECP256R1()),
                                      serialization.NoEncryption()))
    out.encrypted_key.write_bytes(key_pem(key, serialization.BestAvailableEncryption(b"pw")))
    return out


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "web.yml"
    path.write_text(text)
    return str(path)


def _load(tmp_path: Path, text: str) -> WebConfig:
    return load_web_config(_write(tmp_path, text))


def _error(tmp_path: Path, text: str) -> str:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_web_config(path)
    msg = str(err.value)
    assert "\n" not in msg
    prefix = f"web config file {path}"
    assert msg.startswith(prefix), msg
    return msg[len(prefix):]


def _tls(files: Files, extra: str = "") -> str:
    return f"tls_server_config:\n  cert_file: {files.cert}\n  key_file: {files.key}\n{extra}"


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _hash(password: str | bytes) -> str:
    raw = password.encode() if isinstance(password, str) else password
    return bcrypt.hashpw(raw, bcrypt.gensalt(4)).decode()


# -- no file, an empty file --------------------------------------------------------------------

def test_no_file_asks_for_nothing() -> None:
    for path in (None, ""):
        web = load_web_config(path)
        assert web == WebConfig()
        assert (web.path, web.tls, web.auth, dict(web.users), dict(web.headers)) == (
            None, None, None, {}, {})
        assert web.client_auth == "NoClientCert"
        assert web.summary() == "no TLS, no basic auth"


def test_an_empty_file_or_empty_sections_ask_for_nothing(tmp_path) -> None:
    for text in ("", "# nothing\n", "tls_server_config:\nhttp_server_config:\n"
                 "basic_auth_users:\n", "tls_server_config: {}\nhttp_server_config: {}\n"
                 "basic_auth_users: {}\n",
                 "http_server_config:\n  http2: null\n  headers:\n"):
        web = _load(tmp_path, text)
        assert web.tls is None and web.auth is None and not web.users and not web.headers
        assert web.path == str(tmp_path / "web.yml") and web.client_auth == "NoClientCert"
        assert web.summary() == "no TLS, no basic auth"


def test_a_file_that_is_not_a_mapping(tmp_path) -> None:
    assert _error(tmp_path, "- a\n") == (
        " must hold a mapping (tls_server_config, http_server_config, basic_auth_users)")


# -- keys --------------------------------------------------------------------------------------

def test_an_unknown_key_lists_the_known_ones(tmp_path, files) -> None:
    assert _error(tmp_path, "tls_config: {}\n") == (
        ": unknown key 'tls_config' (known: tls_server_config, http_server_config, "
        "basic_auth_users)")
    assert _error(tmp_path, _tls(files, "  cert_fil: x\n")) == (
        ": unknown key 'tls_server_config.cert_fil' (known: cert_file, key_file, "
        "client_auth_type, client_ca_file, client_ca, min_version, max_version, "
        "prefer_server_cipher_suites)")
    assert _error(tmp_path, "http_server_config: {http3: true}\n") == (
        ": unknown key 'http_server_config.http3' (known: http2, headers)")


@pytest.mark.parametrize(("text", "message"), [
    ("rate_limit: {interval: 1s}\n",
     "rate_limit is not supported by mrc-agent (put a rate limit in front of the agent)"),
    ("tls_server_config: {cert: x}\n",
     "tls_server_config.cert is not supported by mrc-agent (give the certificate as cert_file)"),
    ("tls_server_config: {key: x}\n",
     "tls_server_config.key is not supported by mrc-agent (give the key as key_file)"),
    ("tls_server_config: {cipher_suites: [TLS_AES_128_GCM_SHA256]}\n",
     "tls_server_config.cipher_suites is not supported by mrc-agent (OpenSSL's defaults apply)"),
    ("tls_server_config: {curve_preferences: [X25519]}\n",
     "tls_server_config.curve_preferences is not supported by mrc-agent "
     "(OpenSSL's defaults apply)"),
    ("tls_server_config: {client_allowed_sans: [a]}\n",
     "tls_server_config.client_allowed_sans is not supported by mrc-agent "
     "(issue client certificates from a CA of their own)"),
    ("http_server_config: {rate_limit: 0}\n",
     "http_server_config.rate_limit is not supported by mrc-agent "
     "(put a rate limit in front of the agent)"),
])
def test_a_key_the_agent_does_not_implement_is_refused_when_set(tmp_path, text,
                                                                message) -> None:
    assert _error(tmp_path, text) == ": " + message


def test_a_key_the_agent_does_not_implement_is_ignored_when_set_to_nothing(tmp_path) -> None:
    web = _load(tmp_path, "rate_limit:\ntls_server_config:\n  cipher_suites: []\n"
                          "  cert: ''\n  curve_preferences: {}\n")
    assert web.tls is None
    # ... and the keys after it are still checked.
    assert _error(tmp_path, "rate_limit:\nbogus: 1\n") == (
        ": unknown key 'bogus' (known: tls_server_config, http_server_config, "
        "basic_auth_users)")


def test_a_section_must_be_a_mapping(tmp_path) -> None:
    assert _error(tmp_path, "tls_server_config: [a]\n") == (
        ": tls_server_config must be a mapping")
    assert _error(tmp_path, "http_server_config: yes\n") == (
        ": http_server_config must be a mapping")


def test_a_key_given_twice_is_refused_with_its_line(tmp_path) -> None:
    assert _error(tmp_path, "http_server_config: {}\nbasic_auth_users:\n  a: x\n  b: y\n"
                            "  a: z\n") == (":5 is not valid YAML: key 'a' given twice")
    assert _error(tmp_path, "http_server_config: {}\nhttp_server_config: {}\n") == (
        ":2 is not valid YAML: key 'http_server_config' given twice")


def test_an_unhashable_key_is_a_yaml_error(tmp_path) -> None:
    assert _error(tmp_path, "? [a]\n: 1\n") == ":1 is not valid YAML"
    # The first problem is the one reported, not a key given twice after it.
    assert _error(tmp_path, "? [a]\n: 1\nb: 2\nb: 3\n") == ":1 is not valid YAML"


def test_the_strict_loader_still_reads_nested_mappings() -> None:
    data = w.yaml.load("a: {b: {c: 1}}\nd: [1, {e: 2}]\n", Loader=w._StrictLoader)
    assert data == {"a": {"b": {"c": 1}}, "d": [1, {"e": 2}]}


# -- TLS ---------------------------------------------------------------------------------------

def test_a_cert_and_key_turn_tls_on_with_the_defaults(tmp_path, files) -> None:
    web = _load(tmp_path, _tls(files))
    ctx = web.tls
    assert isinstance(ctx, ssl.SSLContext) and ctx.protocol == ssl.PROTOCOL_TLS_SERVER
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert ctx.maximum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.verify_mode == ssl.CERT_NONE
    assert ctx.options & ssl.OP_CIPHER_SERVER_PREFERENCE
    assert ctx.get_ca_certs() == []
    assert web.client_auth == "NoClientCert"
    assert web.summary() == "TLS (client certificates: NoClientCert), no basic auth"


def test_relative_paths_are_relative_to_the_files_directory(files) -> None:
    path = files.cert.parent / "relative.yml"
    path.write_text("tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n")
    assert load_web_config(str(path)).tls is not None


@pytest.mark.parametrize(("versions", "low", "high"), [
    ("  min_version: TLS12\n  max_version: TLS12\n", ssl.TLSVersion.TLSv1_2,
     ssl.TLSVersion.TLSv1_2),
    ("  min_version: TLS13\n", ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_3),
    ("  max_version: TLS12\n", ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_2),
    ("  min_version: ''\n  max_version: null\n", ssl.TLSVersion.TLSv1_2,
     ssl.TLSVersion.TLSv1_3),
])
def test_tls_versions_apply(tmp_path, files, versions, low, high) -> None:
    ctx = _load(tmp_path, _tls(files, versions)).tls
    assert ctx is not None
    assert (ctx.minimum_version, ctx.maximum_version) == (low, high)


def test_bad_tls_versions(tmp_path, files) -> None:
    assert _error(tmp_path, _tls(files, "  min_version: TLS14\n")) == (
        f": {TLS}min_version 'TLS14' is not one of TLS10, TLS11, TLS12, TLS13")
    assert _error(tmp_path, _tls(files, "  max_version: tls13\n")) == (
        f": {TLS}max_version 'tls13' is not one of TLS10, TLS11, TLS12, TLS13")
    assert _error(tmp_path, _tls(files, "  min_version: TLS13\n  max_version: TLS12\n")) == (
        f": {TLS}min_version is above max_version")
    assert _error(tmp_path, _tls(files, "  min_version: 1.2\n")) == (
        f": {TLS}min_version must be a string, not 1.2")


def test_prefer_server_cipher_suites(tmp_path, files) -> None:
    off = _load(tmp_path, _tls(files, "  prefer_server_cipher_suites: false\n")).tls
    assert off is not None and not off.options & ssl.OP_CIPHER_SERVER_PREFERENCE
    default = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).options
    assert off.options == default & ~ssl.OP_CIPHER_SERVER_PREFERENCE  # the others are kept
    on = _load(tmp_path, _tls(files, "  prefer_server_cipher_suites: true\n")).tls
    assert on is not None and on.options & ssl.OP_CIPHER_SERVER_PREFERENCE
    unset = _load(tmp_path, _tls(files, "  prefer_server_cipher_suites: null\n")).tls
    assert unset is not None and unset.options & ssl.OP_CIPHER_SERVER_PREFERENCE
    assert _error(tmp_path, _tls(files, "  prefer_server_cipher_suites: 'no'\n")) == (
        f": {TLS}prefer_server_cipher_suites must be true or false, not 'no'")


@pytest.mark.parametrize(("extra", "missing"), [
    ("tls_server_config:\n  client_auth_type: NoClientCert\n", "cert_file"),
    ("tls_server_config:\n  client_ca: x\n", "cert_file"),
    ("tls_server_config:\n  client_ca_file: ca.pem\n", "cert_file"),
    ("tls_server_config:\n  key_file: key.pem\n", "cert_file"),
    ("tls_server_config:\n  cert_file: cert.pem\n", "key_file"),
    ("tls_server_config:\n  cert_file: cert.pem\n  key_file: ''\n", "key_file"),
])
def test_any_tls_setting_turns_tls_on_and_then_needs_a_cert_and_a_key(tmp_path, extra,
                                                                      missing) -> None:
    assert _error(tmp_path, extra) == f": {TLS}{missing} is missing"


def test_tls_paths_must_be_strings(tmp_path) -> None:
    assert _error(tmp_path, "tls_server_config:\n  cert_file: 5\n") == (
        f": {TLS}cert_file must be a string, not 5")
    assert _error(tmp_path, "tls_server_config:\n  client_auth_type: [a]\n") == (
        f": {TLS}client_auth_type must be a string, not ['a']")
    assert _error(tmp_path, "tls_server_config:\n  client_ca: 5\n") == (
        f": {TLS}client_ca must be a string, not 5")


def test_an_unknown_client_auth_type_lists_the_known_ones(tmp_path, files) -> None:
    assert _error(tmp_path, _tls(files, "  client_auth_type: Sometimes\n")) == (
        f": {TLS}client_auth_type 'Sometimes' is not one of NoClientCert, RequestClientCert, "
        "RequireAnyClientCert, RequireClientCert, VerifyClientCertIfGiven, "
        "RequireAndVerifyClientCert")


@pytest.mark.parametrize(("auth", "mode"), [
    ("RequestClientCert", ssl.CERT_NONE),
    ("RequireAnyClientCert", ssl.CERT_REQUIRED),
    ("RequireClientCert", ssl.CERT_REQUIRED),
    ("VerifyClientCertIfGiven", ssl.CERT_OPTIONAL),
    ("RequireAndVerifyClientCert", ssl.CERT_REQUIRED),
])
def test_each_client_auth_type_with_a_ca_file(tmp_path, files, auth, mode) -> None:
    web = _load(tmp_path, _tls(files, f"  client_auth_type: {auth}\n"
                                      f"  client_ca_file: {files.cert}\n"))
    assert web.tls is not None and web.tls.verify_mode == mode
    assert len(web.tls.get_ca_certs()) == 1
    assert web.client_auth == auth
    assert web.summary() == f"TLS (client certificates: {auth}), no basic auth"


def test_request_client_cert_needs_no_ca(tmp_path, files) -> None:
    web = _load(tmp_path, _tls(files, "  client_auth_type: RequestClientCert\n"))
    assert web.tls is not None and web.tls.verify_mode == ssl.CERT_NONE
    assert web.tls.get_ca_certs() == []


def test_the_client_ca_inline(tmp_path, files) -> None:
    ca = files.ca_pem.replace("\n", "\n    ")
    web = _load(tmp_path, _tls(files, "  client_auth_type: VerifyClientCertIfGiven\n"
                                      f"  client_ca: |\n    {ca}\n"))
    assert web.tls is not None and web.tls.verify_mode == ssl.CERT_OPTIONAL
    assert len(web.tls.get_ca_certs()) == 1


@pytest.mark.parametrize("auth", ["RequireAnyClientCert", "VerifyClientCertIfGiven",
                                  "RequireAndVerifyClientCert"])
def test_verifying_client_certificates_needs_a_ca(tmp_path, files, auth) -> None:
    assert _error(tmp_path, _tls(files, f"  client_auth_type: {auth}\n")) == (
        f": client_auth_type {auth} needs {TLS}client_ca_file, the CA that signs the client "
        "certificates")


def test_a_ca_without_client_auth_or_two_cas_are_refused(tmp_path, files) -> None:
    assert _error(tmp_path, _tls(files, f"  client_ca_file: {files.cert}\n")) == (
        ": a client CA is given but client_auth_type is NoClientCert")
    assert _error(tmp_path, _tls(files, "  client_ca: x\n")) == (
        ": a client CA is given but client_auth_type is NoClientCert")
    assert _error(tmp_path, _tls(files, "  client_auth_type: NoClientCert\n"
                                        "  client_ca: x\n")) == (
        ": a client CA is given but client_auth_type is NoClientCert")
    assert _error(tmp_path, _tls(files, "  client_auth_type: VerifyClientCertIfGiven\n"
                                        f"  client_ca_file: {files.cert}\n"
                                        "  client_ca: x\n")) == (
        f": give {TLS}client_ca_file or client_ca, not both")


def test_a_client_ca_that_does_not_load(tmp_path, files) -> None:
    given = "  client_auth_type: VerifyClientCertIfGiven\n"
    assert _error(tmp_path, _tls(files, given + "  client_ca: not a certificate\n")) == (
        ": client_ca holds no PEM certificate")
    assert _error(tmp_path, _tls(files, given + f"  client_ca_file: {files.key}\n")) == (
        f": client_ca_file {files.key} holds no PEM certificate")
    broken = "-----BEGIN CERTIFICATE-----\\nAAAA\\n-----END CERTIFICATE-----\\n"
    assert _error(tmp_path, _tls(files, given + f'  client_ca: "{broken}"\n')) == (
        ": client_ca does not load: no start line: cadata does not contain a certificate")
    bad_file = tmp_path / "bad-ca.pem"
    bad_file.write_text(broken.replace("\\n", "\n"))
    assert _error(tmp_path, _tls(files, given + f"  client_ca_file: {bad_file}\n")) == (
        f": client_ca_file {bad_file} does not load: "
        "no start line: cadata does not contain a certificate")
    accented = "-----BEGIN CERTIFICATE-----\\n\u00e9\\n-----END CERTIFICATE-----\\n"
    assert _error(tmp_path, _tls(files, given + f'  client_ca: "{accented}"\n')).startswith(
        ": client_ca does not load: 'ascii' codec can't decode")


def test_a_cert_or_key_that_is_missing_or_not_pem(tmp_path, files) -> None:
    missing = tmp_path / "missing.pem"
    assert _error(tmp_path, _tls(files).replace(str(files.cert), str(missing))) == (
        f": cannot read cert_file {missing}: No such file or directory")
    assert _error(tmp_path, _tls(files).replace(str(files.cert), str(files.key))) == (
        f": cert_file {files.key} holds no PEM certificate")
    assert _error(tmp_path, _tls(files).replace(str(files.key), str(files.cert))) == (
        f": key_file {files.cert} holds no PEM private key")
    big = tmp_path / "big.pem"
    big.write_bytes(b"-----BEGIN CERTIFICATE-----" + b"A" * (1 << 20))
    assert _error(tmp_path, _tls(files).replace(str(files.cert), str(big))) == (
        f": cannot read cert_file {big}: cert_file {big} is {(1 << 20) + 27} bytes; "
        f"at most {1 << 20} are read")


def test_a_key_of_another_certificate_or_an_encrypted_one(tmp_path, files) -> None:
    assert _error(tmp_path, _tls(files).replace(str(files.key), str(files.other_key))) == (
        f": cert_file {files.cert} and key_file {files.other_key} do not load: "
        "key values mismatch")
    assert _error(tmp_path, _tls(files).replace(str(files.key), str(files.encrypted_key))) == (
        f": key_file {files.encrypted_key} is encrypted; give it unencrypted (as "
        "exporter-toolkit needs it)")


def test_an_openssl_reason_loses_its_tag_and_source_line() -> None:
    exc = ssl.SSLError(116, "[SSL: KEY_VALUES_MISMATCH] key values mismatch (_ssl.c:3926)")
    assert w._ssl_reason(exc) == "key values mismatch"
    assert w._ssl_reason(OSError(2, "[x] gone (_ssl.c:1)")) == "gone"
    assert w._ssl_reason(OSError("alone")) == "alone"
    assert w._ssl_reason(ValueError("[a] b [c] (_ssl.c:12) d")) == "b [c] (_ssl.c:12) d"
    assert w._ssl_reason(ValueError("no tag  (_ssl.c:7)")) == "no tag"


def test_the_passphrase_callback_never_prompts() -> None:
    with pytest.raises(w._Encrypted):
        w._no_passphrase()


# -- headers -----------------------------------------------------------------------------------

def test_headers_exporter_toolkit_lets_a_file_set(tmp_path) -> None:
    web = _load(tmp_path, "http_server_config:\n  http2: false\n  headers:\n"
                          "    X-XSS-Protection: ''\n"
                          "    Strict-Transport-Security: max-age=31536000\n"
                          "    Content-Security-Policy:\n"
                          "    X-Content-Type-Options: nosniff\n"
                          "    X-Frame-Options: sameorigin\n")
    assert dict(web.headers) == {"Strict-Transport-Security": "max-age=31536000",
                                 "X-Content-Type-Options": "nosniff",
                                 "X-Frame-Options": "sameorigin"}
    assert web.summary() == ("no TLS, no basic auth, headers Strict-Transport-Security, "
                             "X-Content-Type-Options, X-Frame-Options")


@pytest.mark.parametrize(("headers", "message"), [
    ("{Server: nginx}", "header 'Server' cannot be set (exporter-toolkit lets a file set "
                        "Strict-Transport-Security, X-Content-Type-Options, X-Frame-Options, "
                        "X-XSS-Protection, Content-Security-Policy)"),
    ("{x-frame-options: deny}", "header 'x-frame-options' cannot be set"),
    ("{X-Frame-Options: allow-from}",
     "header X-Frame-Options 'allow-from' is not one of deny, sameorigin"),
    ("{X-Frame-Options: DENY}", "header X-Frame-Options 'DENY' is not one of deny, sameorigin"),
    ("{X-Content-Type-Options: sniff}",
     "header X-Content-Type-Options 'sniff' is not one of nosniff"),
    ("{X-XSS-Protection: 1}", "header X-XSS-Protection must be one line of ASCII text"),
    ('{X-XSS-Protection: "a\\nb"}', "header X-XSS-Protection must be one line of ASCII text"),
    ('{X-XSS-Protection: "caf\u00e9"}',
     "header X-XSS-Protection must be one line of ASCII text"),
    ("[X-Frame-Options]", "http_server_config.headers must be a mapping"),
])
def test_bad_headers(tmp_path, headers, message) -> None:
    msg = _error(tmp_path, f"http_server_config:\n  headers: {headers}\n")
    assert msg.startswith(": " + message), msg
    if "cannot be set" not in message:
        assert msg == ": " + message


def test_http2_is_checked_then_ignored(tmp_path) -> None:
    assert _load(tmp_path, "http_server_config: {http2: true}\n").headers == {}
    assert _error(tmp_path, "http_server_config: {http2: 'on'}\n") == (
        ": http_server_config.http2 must be true or false, not 'on'")


# -- basic auth users --------------------------------------------------------------------------

@pytest.mark.parametrize("hashed", [
    "$2a$04$" + "A" * 53, "$2b$10$" + "./Az09" * 8 + "abcde", "$2y$31$" + "z" * 53,
    "$2b$19$" + "z" * 53, "$2b$20$" + "z" * 53,
])
def test_bcrypt_hashes_accepted(tmp_path, hashed) -> None:
    web = _load(tmp_path, f"basic_auth_users:\n  alice: '{hashed}'\n")
    assert dict(web.users) == {"alice": hashed}
    assert isinstance(web.auth, BasicAuth)
    assert web.summary() == "no TLS, basic auth for 1 user(s)"


@pytest.mark.parametrize("hashed", [
    "wonderland", "$2x$10$" + "A" * 53, "$2b$03$" + "A" * 53, "$2b$32$" + "A" * 53,
    "$2b$10$" + "A" * 52, "$2b$10$" + "A" * 54, "$2b$10$" + "A" * 52 + "!",
    "$2b$1$" + "A" * 53, " $2b$10$" + "A" * 53, "$1$10$" + "A" * 53, "$2b$40$" + "A" * 53,
])
def test_other_passwords_are_not_bcrypt_hashes(tmp_path, hashed) -> None:
    assert _error(tmp_path, f"basic_auth_users:\n  alice: '{hashed}'\n") == (
        ": basic_auth_users: the password of 'alice' is not a bcrypt hash (make one with: "
        "htpasswd -nBC 10 \"\" | tr -d ':\\n')")


def test_basic_auth_users_must_map_names_to_hashes(tmp_path) -> None:
    assert _error(tmp_path, "basic_auth_users: [alice]\n") == (
        ": basic_auth_users must map user names to bcrypt hashes")
    assert _error(tmp_path, f"basic_auth_users:\n  123: '{'$2b$04$' + 'A' * 53}'\n") == (
        ": basic_auth_users: user name 123 must be a string (quote it)")
    assert _error(tmp_path, "basic_auth_users:\n  alice: 5\n").startswith(
        ": basic_auth_users: the password of 'alice' is not a bcrypt hash")


def test_the_summary_counts_users_and_names_headers(tmp_path, files) -> None:
    text = (_tls(files) + f"basic_auth_users:\n  a: '{_hash('x')}'\n  b: '{_hash('y')}'\n"
            "http_server_config:\n  headers: {X-Frame-Options: deny}\n")
    assert _load(tmp_path, text).summary() == (
        "TLS (client certificates: NoClientCert), basic auth for 2 user(s), "
        "headers X-Frame-Options")


# -- the basic-auth check ----------------------------------------------------------------------

def test_the_right_password_passes_and_others_do_not() -> None:
    auth = BasicAuth({"alice": _hash("wonderland")})
    assert auth.check(_basic("alice", "wonderland")) is True
    assert auth.check(_basic("alice", "wonderland!")) is False
    assert auth.check(_basic("mallory", "wonderland")) is False
    assert auth.check(None) is False and auth.check("Bearer x") is False


def test_a_password_is_cut_at_72_bytes_as_bcrypt_cuts_it() -> None:
    auth = BasicAuth({"long": _hash("x" * 72)})
    assert auth.check(_basic("long", "x" * 72 + "ignored")) is True
    assert auth.check(_basic("long", "x" * 71)) is False


def test_an_unknown_user_is_checked_against_the_decoy(monkeypatch) -> None:
    seen: list[bytes] = []
    real = bcrypt.checkpw

    def checkpw(password: bytes, hashed: bytes) -> bool:
        seen.append(hashed)
        return real(password, hashed)

    monkeypatch.setattr(w.bcrypt, "checkpw", checkpw)
    alice = _hash("a")
    auth = BasicAuth({"alice": alice})
    assert auth.check(_basic("mallory", "a")) is False  # alice's password, no such user
    assert seen == [alice.encode()]  # the costliest configured hash is the decoy
    assert BasicAuth({}).check(_basic("mallory", "a")) is False
    assert seen[-1] == w._DECOY  # no user configured: the built-in one
    monkeypatch.setattr(w.bcrypt, "checkpw", lambda password, hashed: True)
    assert auth.check(_basic("mallory", "a")) is False  # even were the decoy to match
    assert auth.cached(_basic("mallory", "a")) is None


def test_a_hash_that_bcrypt_refuses_fails_with_a_warning(caplog) -> None:
    auth = BasicAuth({"alice": "$2y$04$" + "A" * 53})
    with caplog.at_level(logging.WARNING, logger=w.log.name):
        assert auth.check(_basic("alice", "a")) is False
    assert [r.getMessage() for r in caplog.records] == [
        "basic auth: the hash of user b'alice' does not check: Invalid salt"]
    assert auth.cached(_basic("alice", "a")) is None


def test_a_remembered_pair_is_not_checked_again(monkeypatch) -> None:
    auth = BasicAuth({"alice": _hash("a")})
    assert auth.check(_basic("alice", "a")) is True

    def refuse(password: bytes, hashed: bytes) -> bool:
        raise AssertionError("bcrypt was asked again")

    monkeypatch.setattr(w.bcrypt, "checkpw", refuse)
    assert auth.check(_basic("alice", "a")) is True
    assert auth.cached(_basic("alice", "a")) is True


def test_remembered_pairs_do_not_run_into_each_other() -> None:
    """The user's length is part of what is remembered: ``ab`` + ``c`` is not ``a`` + ``bc``."""
    auth = BasicAuth({"ab": _hash("c"), "a": _hash("bc")})
    assert auth.check(_basic("ab", "c")) is True
    assert auth.cached(_basic("a", "bc")) is None
    assert auth.cached(_basic("ab", "c")) is True
    other = BasicAuth({"ab": _hash("c")})
    assert other.cached(_basic("ab", "c")) is None  # each process has a key of its own


def test_the_cache_keeps_the_newest_64_passes(monkeypatch) -> None:
    monkeypatch.setattr(w.bcrypt, "checkpw", lambda password, hashed: True)
    auth = BasicAuth({f"u{i}": "$2b$04$" + "A" * 53 for i in range(70)})
    for i in range(64):
        assert auth.check(_basic(f"u{i}", "p")) is True
    assert all(auth.cached(_basic(f"u{i}", "p")) for i in range(64))
    auth.check(_basic("u64", "p"))
    assert auth.cached(_basic("u0", "p")) is None
    assert all(auth.cached(_basic(f"u{i}", "p")) for i in range(1, 65))
    auth.check(_basic("u65", "p"))
    assert auth.cached(_basic("u1", "p")) is None and auth.cached(_basic("u2", "p"))


def test_cached_answers_without_bcrypt() -> None:
    auth = BasicAuth({"alice": _hash("a")})
    assert auth.cached(None) is False and auth.cached("") is False
    assert auth.cached("Basic !!!") is False
    assert auth.cached(_basic("alice", "a")) is None


@pytest.mark.parametrize(("header", "expected"), [
    ("  Basic " + base64.b64encode(b"u:p").decode() + "  ", (b"u", b"p")),
    ("BASIC " + base64.b64encode(b"u:p:q").decode(), (b"u", b"p:q")),
    ("Basic  " + base64.b64encode(b":p").decode(), (b"", b"p")),
    ("Basic", None),
    ("Basic dTpw!", None),  # "u:p" and a character base64 does not have: refused, not skipped
    ("Basic " + base64.b64encode(b"u:p").decode()[:-1], None),
    ("Basicx " + base64.b64encode(b"u:p").decode(), None),
])
def test_credentials_edge_cases(header, expected) -> None:
    assert credentials(header) == expected


# -- SIGHUP ------------------------------------------------------------------------------------

def test_a_reload_keeps_the_authenticator_when_the_users_are_the_same(tmp_path) -> None:
    users = f"basic_auth_users:\n  alice: '{_hash('a')}'\n"
    path = _write(tmp_path, users)
    running = load_web_config(path)
    assert running.auth is not None and running.auth.check(_basic("alice", "a"))
    again = reload_web_config(running, path)
    assert again.auth is running.auth
    (tmp_path / "web.yml").write_text(users + "http_server_config:\n  headers: "
                                              "{X-Frame-Options: deny}\n")
    assert reload_web_config(running, path).auth is running.auth
    (tmp_path / "web.yml").write_text(f"basic_auth_users:\n  bob: '{_hash('b')}'\n")
    changed = reload_web_config(running, path)
    assert changed.auth is not None and changed.auth is not running.auth
    assert dict(changed.users) == {"bob": dict(changed.users)["bob"]}
    (tmp_path / "web.yml").write_text("")
    assert reload_web_config(running, path).auth is None
    assert reload_web_config(WebConfig(), path).auth is None


def test_a_reload_may_not_switch_tls_on_or_off(tmp_path, files) -> None:
    path = _write(tmp_path, _tls(files))
    with_tls = load_web_config(path)
    (tmp_path / "web.yml").write_text("")
    with pytest.raises(ConfigError) as err:
        reload_web_config(with_tls, path)
    assert str(err.value) == f"web config file {path}: switching TLS off needs a restart"
    with pytest.raises(ConfigError) as err:
        reload_web_config(with_tls, None)
    assert str(err.value) == "without a web config file: switching TLS off needs a restart"
    (tmp_path / "web.yml").write_text(_tls(files))
    with pytest.raises(ConfigError) as err:
        reload_web_config(WebConfig(), path)
    assert str(err.value) == f"web config file {path}: switching TLS on needs a restart"
    assert reload_web_config(with_tls, path).tls is not None
    assert reload_web_config(WebConfig(), None) == WebConfig()
