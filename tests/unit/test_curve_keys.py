"""CURVE key directories: generation, loading and the errors that name the bad file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvrdma.cli.main import main
from kvrdma.errors import ConfigError
from kvrdma.handshake.auth import CurveKeys, generate_keys

pytestmark = pytest.mark.timeout(30)


def test_generated_keys_load_with_both_clients_authorized(tmp_path: Path) -> None:
    written = generate_keys(tmp_path / "keys")
    assert sorted(p.name for p in written) == [
        "client.key",
        "client.key_secret",
        "server.key",
        "server.key_secret",
    ]
    assert (tmp_path / "keys").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "keys" / "server.key_secret").stat().st_mode & 0o777 == 0o600
    keys = CurveKeys.load(tmp_path / "keys")
    assert keys.server_secret is not None and len(keys.server_public) == 40
    assert keys.client_public in keys.authorized
    assert keys.client_public != keys.server_public


def test_existing_keys_are_kept_unless_forced(tmp_path: Path) -> None:
    generate_keys(tmp_path)
    before = CurveKeys.load(tmp_path)
    with pytest.raises(ConfigError, match=r"already exist.*--force"):
        generate_keys(tmp_path)
    generate_keys(tmp_path, overwrite=True)
    assert CurveKeys.load(tmp_path).server_public != before.server_public


def test_a_client_only_directory_has_no_server_secret(tmp_path: Path) -> None:
    generate_keys(tmp_path / "full")
    client = tmp_path / "client"
    client.mkdir()
    for name in ("server.key", "client.key_secret"):
        shutil.copy(tmp_path / "full" / name, client / name)
    keys = CurveKeys.load(client)
    assert keys.server_secret is None
    assert keys.server_public == CurveKeys.load(tmp_path / "full").server_public


@pytest.mark.parametrize(
    ("remove", "fragment"),
    [("server.key", "server.key"), ("client.key_secret", "client.key_secret")],
)
def test_missing_key_files_are_named(tmp_path: Path, remove: str, fragment: str) -> None:
    generate_keys(tmp_path)
    (tmp_path / remove).unlink()
    with pytest.raises(ConfigError, match=fragment):
        CurveKeys.load(tmp_path)


def test_mismatched_server_pair_and_missing_directory_are_refused(tmp_path: Path) -> None:
    generate_keys(tmp_path / "a")
    generate_keys(tmp_path / "b")
    shutil.copy(tmp_path / "b" / "server.key", tmp_path / "a" / "server.key")
    with pytest.raises(ConfigError, match="not the same key pair"):
        CurveKeys.load(tmp_path / "a")
    with pytest.raises(ConfigError, match=r"does not exist.*kvrdma keygen"):
        CurveKeys.load(tmp_path / "nowhere")


def test_keys_from_the_environment(tmp_path: Path) -> None:
    assert CurveKeys.from_env({}) is None
    assert CurveKeys.from_env({"KVRDMA_CURVE_DIR": ""}) is None
    generate_keys(tmp_path)
    keys = CurveKeys.from_env({"KVRDMA_CURVE_DIR": str(tmp_path)})
    assert keys is not None and keys.directory == str(tmp_path)


def test_keygen_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keygen", str(tmp_path / "k")]) == 0
    out = capsys.readouterr().out
    assert "server.key_secret" in out and "kubectl create secret" in out
    assert main(["keygen", str(tmp_path / "k")]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["keygen", "--force", str(tmp_path / "k")]) == 0
