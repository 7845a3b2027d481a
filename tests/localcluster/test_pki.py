"""The generated certificates name what the clients verify and who they are."""

from __future__ import annotations

import ipaddress

from cryptography import x509
from cryptography.x509.oid import NameOID

from kvpilot.localcluster.pki import KUBERNETES_SERVICE_IP, ensure_pki


def _load(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certificates(tmp_path):
    ensure_pki(tmp_path)
    ca = _load(tmp_path / "ca.crt")
    serving = _load(tmp_path / "apiserver.crt")
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    assert ipaddress.ip_address(KUBERNETES_SERVICE_IP) in sans.get_values_for_type(x509.IPAddress)
    assert "kubernetes.default.svc" in sans.get_values_for_type(x509.DNSName)
    serving.verify_directly_issued_by(ca)

    admin = _load(tmp_path / "admin.crt")
    assert admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    scheduler = _load(tmp_path / "scheduler.crt")
    assert scheduler.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:kube-scheduler"
    assert (tmp_path / "sa.key").stat().st_mode & 0o077 == 0

    before = (tmp_path / "ca.crt").read_bytes()
    ensure_pki(tmp_path)  # idempotent: kubeconfigs stay valid across `up`s
    assert (tmp_path / "ca.crt").read_bytes() == before
