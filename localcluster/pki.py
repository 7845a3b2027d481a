"""Certificates for the local control plane, generated once per state folder.

One self-signed CA signs the API server's serving certificate and a client
certificate per identity; RBAC's bootstrap policy already binds the
controller-manager and scheduler user names, and ``system:masters`` is admin.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

# Kubernetes' service "kubernetes" takes the first address of the service range; the
# serving cert names it so in-cluster style clients that use it still verify.
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class ClientIdentity:
    file_stem: str
    common_name: str
    organization: str | None = None


CLIENTS = (
    ClientIdentity("admin", "kubernetes-admin", "system:masters"),
    ClientIdentity("controller-manager", "system:kube-controller-manager"),
    ClientIdentity("scheduler", "system:kube-scheduler"),
    # The API server's identity when it calls the kubelet stand-in (kubectl logs).
    ClientIdentity("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters"),
)


def _write_key(path: Path, key) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str, organization: str | None = None):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _sign(subject, public_key, ca_name, ca_key, *, is_ca: bool, usages, sans=None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if is_ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def _write_cert(path: Path, cert) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def ensure_pki(directory: Path) -> None:
    """Creates the CA, certificates and service-account keys unless they exist."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID

    if (directory / "complete").exists():
        return
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _new_key()
    ca_name = _name("kvpilot-local-ca")
    ca_cert = _sign(ca_name, ca_key.public_key(), ca_name, ca_key, is_ca=True, usages=None)
    _write_key(directory / "ca.key", ca_key)
    _write_cert(directory / "ca.crt", ca_cert)

    serving_key = _new_key()
    dns_names = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    sans = [x509.DNSName(n) for n in dns_names] + [
        x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", KUBERNETES_SERVICE_IP)
    ]
    serving = _sign(
        _name("kube-apiserver"), serving_key.public_key(), ca_name, ca_key,
        is_ca=False, usages=[ExtendedKeyUsageOID.SERVER_AUTH], sans=sans,
    )  # fmt: skip
    _write_key(directory / "apiserver.key", serving_key)
    _write_cert(directory / "apiserver.crt", serving)

    # The kubelet stand-in serves logs on 127.0.0.1 for the API server.
    kubelet_key = _new_key()
    kubelet = _sign(
        _name("kvpilot-kubelet"), kubelet_key.public_key(), ca_name, ca_key, is_ca=False,
        usages=[ExtendedKeyUsageOID.SERVER_AUTH],
        sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )  # fmt: skip
    _write_key(directory / "kubelet.key", kubelet_key)
    _write_cert(directory / "kubelet.crt", kubelet)

    for client in CLIENTS:
        key = _new_key()
        cert = _sign(
            _name(client.common_name, client.organization), key.public_key(), ca_name, ca_key,
            is_ca=False, usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
        )  # fmt: skip
        _write_key(directory / f"{client.file_stem}.key", key)
        _write_cert(directory / f"{client.file_stem}.crt", cert)

    # Service-account tokens are RS256 by default; an RSA pair signs and verifies them.
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(directory / "sa.key", sa_key)
    (directory / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    (directory / "complete").write_text("")
