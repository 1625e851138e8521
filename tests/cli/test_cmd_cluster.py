"""`prima cluster` makes a CA and identities; a joined device's primad serves under the name in
its certificate, and without one refuses to listen off loopback unless --insecure."""

from __future__ import annotations

from pathlib import Path

import pytest

from prima.cli import primad
from prima.cli.main import main
from prima.errors import InputError
from prima.net import credentials, revocation


def test_init_issue_join(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keeper, phone = tmp_path / "keeper", tmp_path / "phone"
    assert main(["cluster", "--dir", str(keeper), "init", "--name", "laptop"]) == 0
    assert main(["cluster", "--dir", str(keeper), "init"]) == 1  # would replace the cluster
    out = tmp_path / "phone.pem"
    assert main(["cluster", "--dir", str(keeper), "issue", "phone", "-o", str(out)]) == 0
    assert out.stat().st_mode & 0o077 == 0
    assert main(["cluster", "--dir", str(phone), "join", str(out)]) == 0
    laptop_id, phone_id = credentials.load_identity(keeper), credentials.load_identity(phone)
    assert laptop_id is not None
    assert phone_id is not None
    assert (laptop_id.name, phone_id.name) == ("laptop", "phone")
    assert phone_id.roots_pem == laptop_id.roots_pem  # one cluster
    assert not (phone / credentials.CA_KEY_FILE).exists()
    capsys.readouterr()


def _args(tmp_path: Path, *argv: str):
    return primad.build_parser().parse_args(["--cluster-dir", str(tmp_path), *argv])


def test_primad_without_identity_stays_on_loopback(tmp_path: Path) -> None:
    assert primad.load_node_identity(_args(tmp_path, "--host", "127.0.0.1")) is None
    with pytest.raises(InputError, match="prima cluster issue"):
        primad.load_node_identity(_args(tmp_path, "--host", "0.0.0.0"))
    assert primad.load_node_identity(_args(tmp_path, "--host", "0.0.0.0", "--insecure")) is None


def test_primad_serves_under_its_certificates_name(tmp_path: Path) -> None:
    ca = credentials.ClusterCA.create()
    credentials.write_private(tmp_path / credentials.IDENTITY_FILE, ca.issue("phone").to_pem())
    args = _args(tmp_path, "--host", "0.0.0.0")
    assert primad.load_node_identity(args) is not None
    assert args.name == "phone"
    with pytest.raises(InputError, match="differs"):
        primad.load_node_identity(_args(tmp_path, "--host", "0.0.0.0", "--name", "other"))


def test_revoke_writes_a_list_of_that_names_certificates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keeper = tmp_path / "keeper"
    assert main(["cluster", "--dir", str(keeper), "init", "--name", "laptop"]) == 0
    for _ in range(2):  # phone was issued twice: both certificates go
        assert main(["cluster", "--dir", str(keeper), "issue", "phone", "-o", str(tmp_path / "p.pem")]) == 0
    assert main(["cluster", "--dir", str(keeper), "revoke", "phone"]) == 0
    crl = (keeper / revocation.REVOKED_FILE).read_bytes()
    ca = credentials.ClusterCA.load(keeper)
    assert revocation.load_crl(crl, ca.cert_pem, "crl") == frozenset(
        revocation.issued_serials(keeper, "phone")
    )
    assert main(["cluster", "--dir", str(keeper), "revoke", "tablet"]) == 1  # never issued
    assert "no certificate issued to 'tablet'" in capsys.readouterr().err


def test_primad_refuses_a_coordinators_identity(tmp_path: Path) -> None:
    ca = credentials.ClusterCA.create()
    laptop = ca.issue("laptop", role=credentials.ROLE_COORDINATOR)
    credentials.write_private(tmp_path / credentials.IDENTITY_FILE, laptop.to_pem())
    with pytest.raises(InputError, match="coordinator's, which may call daemons but not serve"):
        primad.load_node_identity(_args(tmp_path, "--host", "0.0.0.0"))


def test_primad_bounds_come_from_its_flags(tmp_path: Path) -> None:
    limits = primad.daemon_limits(
        _args(tmp_path, "--max-sessions", "3", "--max-kv-mib", "64", "--max-generates", "2")
    )
    assert (limits.max_sessions, limits.max_kv_bytes, limits.max_generates_per_caller) == (3, 64 << 20, 2)
    assert primad.daemon_limits(_args(tmp_path)).max_kv_bytes > 0  # a quarter of this machine's RAM


def test_issue_says_the_next_step_for_each_role(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keeper = tmp_path / "keeper"
    assert main(["cluster", "--dir", str(keeper), "init", "--name", "laptop"]) == 0
    capsys.readouterr()
    node, laptop = tmp_path / "phone.pem", tmp_path / "desk.pem"
    assert main(["cluster", "--dir", str(keeper), "issue", "phone", "-o", str(node)]) == 0
    assert "then start primad there" in capsys.readouterr().out
    argv = ["cluster", "--dir", str(keeper), "issue", "desk", "--role", "coordinator", "-o", str(laptop)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "primad" not in out  # a coordinator's identity cannot serve as a daemon
    assert "`prima run`, `chat` and `serve` there reach the cluster's daemons" in out
