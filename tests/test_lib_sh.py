"""The shell helpers of scripts/lib.sh that the developer scripts and CI print and decide with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parent.parent / "scripts" / "lib.sh"


def lib(*command: str) -> subprocess.CompletedProcess[str]:
    """``command`` run by bash after sourcing lib.sh."""
    return subprocess.run(
        ["bash", "-c", f'source "{LIB}" && "$@"', "lib.sh", *command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:s3cret@h:5432/db", "postgresql://u:***@h:5432/db"),
        (
            "postgresql://u@h/db?password=s3cret&sslmode=require",
            "postgresql://u@h/db?password=***&sslmode=require",
        ),
        (
            "postgresql://u@h/db?sslmode=require&sslpassword=k3y",
            "postgresql://u@h/db?sslmode=require&sslpassword=***",
        ),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_redact_hides_every_password_a_url_can_carry(url: str, shown: str) -> None:
    assert lib("redact", url).stdout == f"{shown}\n"


def test_a_venv_without_pip_counts_as_broken(tmp_path: Path) -> None:
    """What a `python3 -m venv` that failed half-way leaves (Debian without python3-venv): a
    python, no pip. ensure_venv makes such a .venv again instead of failing in it for good."""
    half = tmp_path / "half"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(half)], check=True)
    assert lib("venv_works", str(half)).returncode != 0
    assert lib("venv_works", str(tmp_path / "missing")).returncode != 0
    assert lib("venv_works", str(Path(sys.prefix))).returncode == 0
