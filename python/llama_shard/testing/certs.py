"""Certificates for tests and benchmarks: a CA, and server or client certificates it signs, written
as PEM files (needs the `cryptography` package, a test dependency).

    ca = CertificateAuthority.create(tmp_path, "test-ca")
    server = ca.issue("worker", server=True)     # for 127.0.0.1 and localhost
    client = ca.issue("alice")                   # its common name is the principal
    serve --tls-cert server.cert --tls-key server.key --tls-client-ca ca.cert
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import warnings
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


@dataclasses.dataclass
class CertificateAuthority:
    directory: Path
    name: str
    cert: Path
    _key: object
    _cert: object

    @classmethod
    def create(cls, directory: str | Path, name: str) -> "CertificateAuthority":
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, name)])
        cert = (
            _builder(subject, subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, _sha256())
        )
        path = directory / f"{name}.cert"
        path.write_bytes(_pem(cert))
        return cls(directory, name, path, key, cert)

    def issue(self, common_name: str | None, server: bool = False) -> Issued:
        """A certificate for `common_name`, signed by this CA; a server one is valid for 127.0.0.1
        and localhost. For tests of what a worker must refuse: "" issues an empty common name
        (which X.509 libraries would not build unasked), None a subject without one (an O only)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP256R1())
        if common_name is None:
            subject = x509.Name([x509.NameAttribute(x509.NameOID.ORGANIZATION_NAME, "no-common-name")])
        else:
            with warnings.catch_warnings():  # unvalidated, cryptography builds an empty name (with a warning)
                warnings.simplefilter("ignore", UserWarning)
                subject = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, common_name, _validate=False)])
        builder = _builder(subject, self._cert.subject, key.public_key()).add_extension(  # type: ignore[attr-defined]
            x509.BasicConstraints(ca=False, path_length=None), critical=True
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        cert = builder.sign(self._key, _sha256())
        label = {None: "no-cn", "": "empty-cn"}.get(common_name, common_name)
        stem = self.directory / f"{self.name}-{label}"
        stem.with_suffix(".cert").write_bytes(_pem(cert))
        stem.with_suffix(".key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return Issued(stem.with_suffix(".cert"), stem.with_suffix(".key"))


def _builder(subject, issuer, public_key):
    from cryptography import x509

    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
    )


def _sha256():
    from cryptography.hazmat.primitives import hashes

    return hashes.SHA256()


def _pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)
