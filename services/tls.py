"""TLS for the servers the project ships (the mesh, the IOA network server) and for their clients (the Python
client, the relay, the CLI): certificate, key and CA files read and checked before anything listens or
connects, so a missing file, a key that does not belong to its certificate or an expired certificate is
refused at start with a message naming the setting and the file (docs/security.md).

A server with a certificate and key serves TLS; with a client CA too, mutual TLS (a client must present a
certificate that CA signed). A client with a CA trusts servers that CA signed (the system's roots without
one); with its own certificate and key it can prove itself to a mutual-TLS server. Without any, plaintext:
allowed for a server only on a loopback address unless it is told so explicitly (`--insecure`)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason

MAX_PEM_BYTES = 1 << 20
"""A certificate, key or CA file larger than this is refused (a PEM chain is a few KiB)."""


@dataclass(frozen=True)
class TlsFiles:
    """The TLS files of one server or one client, each with the setting it came from (for messages)."""

    cert: Path | None = None
    """A server's certificate chain (PEM), or a client's own certificate for mutual TLS."""
    key: Path | None = None
    """The private key of `cert` (PEM, unencrypted)."""
    ca: Path | None = None
    """A server: the CA whose client certificates it requires (mutual TLS). A client: the CA it trusts."""
    names: tuple[str, str, str] = ("--tls-cert", "--tls-key", "--tls-ca")
    """The settings `cert`, `key` and `ca` came from, as messages name them."""

    @property
    def any(self) -> bool:
        return self.cert is not None or self.key is not None or self.ca is not None


def is_loopback(host: str) -> bool:
    """Whether a listen address is on this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def certified_names(context: grpc.aio.ServicerContext) -> list[str]:
    """The names the call's client certificate holds, common name first, then its subject alternative
    names; none without a client certificate (a certificate without a common name has an empty one)."""
    found = context.auth_context()
    return [value.decode(errors="replace") for key in ("x509_common_name", "x509_subject_alternative_name")
            for value in found.get(key, ()) if value]


def mode(files: TlsFiles) -> str:
    """How a server with these files serves: "plaintext", "TLS" or "mutual TLS"."""
    if files.cert is None:
        return "plaintext"
    return "mutual TLS" if files.ca is not None else "TLS"


def server_credentials(files: TlsFiles, what: str) -> grpc.ServerCredentials | None:
    """The credentials `what` (a server) listens with; None for plaintext. Raises InvalidArgument (BAD_CONFIG)
    naming the setting and file for a file that is missing, unreadable or not PEM, a key that does not
    belong to the certificate, a certificate not valid now, or a client CA without a certificate."""
    cert_name, key_name, ca_name = files.names
    if files.cert is None and files.key is None:
        if files.ca is not None:
            raise _bad(what, ca_name, f"{ca_name} (mutual TLS) needs {cert_name} and {key_name}: a server"
                                      " without its own certificate cannot ask for a client's")
        return None
    cert, key = _pair(files, what)
    ca = _certificates(files.ca, ca_name, what) if files.ca is not None else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def listen_credentials(files: TlsFiles, host: str, insecure: bool, what: str) -> grpc.ServerCredentials | None:
    """The credentials a server listens with (None: plaintext), refusing plaintext beyond this machine
    unless allowed (`insecure`)."""
    credentials = server_credentials(files, what)
    if credentials is None and not insecure and not is_loopback(host):
        raise errors.InvalidArgument(
            f"{what} would listen on {errors.clip(host, 100)} in plaintext: agent credentials and tokens would"
            f" cross the network in the clear. Give {files.names[0]} and {files.names[1]} (TLS), or --insecure"
            " to allow plaintext beyond this machine", reason=Reason.BAD_CONFIG, metadata={"setting": "--insecure"})
    return credentials


def channel_credentials(files: TlsFiles, what: str) -> grpc.ChannelCredentials | None:
    """The credentials a client (`what`) connects with; None for plaintext (no file given). A CA alone:
    TLS trusting that CA; a certificate and key too: mutual TLS."""
    if not files.any:
        return None
    cert_name, key_name, ca_name = files.names
    ca = _certificates(files.ca, ca_name, what) if files.ca is not None else None
    cert = key = None
    if files.cert is not None or files.key is not None:
        cert, key = _pair(files, what)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def ssl_context(files: TlsFiles, what: str) -> ssl.SSLContext | None:
    """An SSL context for a client that is not gRPC (the NATS connection): None without files; the files
    checked as channel_credentials checks them."""
    if not files.any:
        return None
    channel_credentials(files, what)  # the same checks and messages
    context = ssl.create_default_context(cafile=str(files.ca) if files.ca is not None else None)
    if files.cert is not None and files.key is not None:
        context.load_cert_chain(str(files.cert), str(files.key))
    return context


def _pair(files: TlsFiles, what: str) -> tuple[bytes, bytes]:
    """The certificate chain and its key, checked to belong together and to be valid now."""
    cert_name, key_name, _ = files.names
    if files.cert is None or files.key is None:
        given, missing = (cert_name, key_name) if files.cert is not None else (key_name, cert_name)
        raise _bad(what, missing, f"{given} needs {missing} too")
    chain = _certificates(files.cert, cert_name, what)
    key_pem = _read(files.key, key_name, what)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise _bad(what, key_name, f"{key_name} {_shown(files.key)} is not an unencrypted PEM private key"
                                   f" ({errors.clip(str(exc), 120)})") from None
    leaf = x509.load_pem_x509_certificates(chain)[0]
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, public) != \
            leaf.public_key().public_bytes(serialization.Encoding.DER, public):
        raise _bad(what, key_name, f"{key_name} {_shown(files.key)} is not the key of the certificate in"
                                   f" {cert_name} {_shown(files.cert)}")
    now = datetime.datetime.now(datetime.UTC)
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise _bad(what, cert_name, f"the certificate in {cert_name} {_shown(files.cert)} is valid from"
                                    f" {leaf.not_valid_before_utc:%Y-%m-%d %H:%M} to"
                                    f" {leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now")
    return chain, key_pem


def _certificates(path: Path, name: str, what: str) -> bytes:
    """A PEM file of one or more certificates."""
    pem = _read(path, name, what)
    try:
        if not x509.load_pem_x509_certificates(pem):
            raise ValueError("no certificate")
    except ValueError as exc:
        raise _bad(what, name, f"{name} {_shown(path)} holds no PEM certificate ({errors.clip(str(exc), 120)})"
                   ) from None
    return pem


def _read(path: Path, name: str, what: str) -> bytes:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise _bad(what, name, f"cannot read {name} {_shown(path)}: {exc.strerror or exc}") from None
    if len(data) > MAX_PEM_BYTES:
        raise _bad(what, name, f"{name} {_shown(path)} is over {MAX_PEM_BYTES} bytes: not a PEM file")
    return data


def _shown(path: Path) -> str:
    return repr(errors.clip(str(path), 200))


def _bad(what: str, setting: str, problem: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"{what}: {problem}", reason=Reason.BAD_CONFIG, metadata={"setting": setting})


# -- certificates for a trial or a private deployment (`inboxmesh certs`) ---------------------------------
CERT_DAYS = 365


def make_certificates(directory: Path, names: list[str]) -> list[Path]:
    """A CA in `directory` (ca.pem, ca.key; the existing one when there is one) and, for each name, a
    certificate and key it signed (NAME.pem, NAME.key) whose common name is the name and whose subject
    alternative names are the name, localhost and 127.0.0.1: good for a server of that host name, a client
    or relay of that identity, on this machine too. Keys are written readable by the owner only. Returns
    the files written."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    written: list[Path] = []

    def write(path: Path, data: bytes, private: bool) -> None:
        path.write_bytes(data)
        if private:
            path.chmod(0o600)
        written.append(path)

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_file, ca_key_file = directory / "ca.pem", directory / "ca.key"
    if ca_file.exists() and ca_key_file.exists():
        ca_cert = x509.load_pem_x509_certificate(ca_file.read_bytes())
        loaded = serialization.load_pem_private_key(ca_key_file.read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{ca_key_file} is not the EC key this command makes")
        ca_key = loaded
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "inboxmesh CA")])
        ca_cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                   .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=False,
                                                encipher_only=False, decipher_only=False), critical=True)
                   .sign(ca_key, hashes.SHA256()))
        write(ca_file, ca_cert.public_bytes(serialization.Encoding.PEM), False)
        write(ca_key_file, key_pem(ca_key), True)
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        alternative = [x509.DNSName(name), x509.DNSName("localhost"),
                       x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
                .add_extension(x509.SubjectAlternativeName(alternative), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                      x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        write(directory / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM), False)
        write(directory / f"{name}.key", key_pem(key), True)
    return written
