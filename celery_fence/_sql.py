"""The SQL that ships with the package: bootstrap, migrations, functions and named queries."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_MIGRATION = re.compile(r"^(\d{4})_(\w+)\.sql$")
# Serializes concurrent installs; the value is arbitrary but fixed ("cfence" in ASCII).
INSTALL_LOCK_KEY = 0x63_66_65_6E_63_65


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def sql_root() -> Traversable:
    """``celery_fence/sql`` in an installed wheel, else the repository's top-level ``sql/``."""
    packaged = files("celery_fence") / "sql"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "sql"


def read(name: str) -> str:
    return (sql_root() / name).read_text(encoding="utf-8")


@cache
def queries() -> dict[str, str]:
    """The named blocks of ``queries.sql``, parsed once."""
    text = read("queries.sql")
    parts = _NAME.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


@cache
def migrations() -> tuple[Migration, ...]:
    found = []
    for entry in (sql_root() / "migrations").iterdir():
        match = _MIGRATION.match(entry.name)
        if match:
            found.append(
                Migration(int(match[1]), entry.name[:-4], entry.read_text(encoding="utf-8"))
            )
    found.sort(key=lambda migration: migration.version)
    return tuple(found)


def latest_version() -> int:
    return migrations()[-1].version


@cache
def install_script() -> str:
    """One idempotent script: bootstrap, each pending migration once, then the functions.

    ``celery-fence install`` runs exactly this text; ``celery-fence install --print`` prints it.
    """
    lines = [
        "-- celery-fence install script: safe to run again; applies only pending migrations.",
        f"SELECT pg_advisory_xact_lock({INSTALL_LOCK_KEY});",
        read("bootstrap.sql").strip(),
    ]
    for migration in migrations():
        lines.append(
            f"DO $celery_fence_install$\nBEGIN\n"
            f"    IF NOT EXISTS (SELECT 1 FROM celery_fence.migrations "
            f"WHERE version = {migration.version}) THEN\n"
            f"        EXECUTE $celery_fence_migration$\n{migration.sql.strip()}\n"
            f"$celery_fence_migration$;\n"
            f"        INSERT INTO celery_fence.migrations (version, name) "
            f"VALUES ({migration.version}, '{migration.name}');\n"
            f"    END IF;\nEND\n$celery_fence_install$;"
        )
    lines.append(read("functions.sql").strip())
    return "\n\n".join(lines) + "\n"
