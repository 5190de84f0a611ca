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


def milliseconds(seconds: float) -> str:
    """A duration for a PostgreSQL setting (``lock_timeout``): whole milliseconds, at least
    one (0 would mean no limit)."""
    return f"{max(1, round(seconds * 1000))}ms"


@cache
def install_script(lock_timeout: float) -> str:
    """One idempotent script, for one transaction: bootstrap, each pending migration once,
    then the functions; on a schema newer than this package's migrations it raises and changes
    nothing. Once it holds the install lock (concurrent installs wait for each
    other, whatever the role's own lock timeout), each lock it takes waits at most
    ``lock_timeout`` seconds: a migration that must lock a table the fleet is using fails
    instead of queueing the fleet's calls behind it. Names resolve in ``pg_catalog`` only, so
    that no function or operator another role created in a schema on the installer's search
    path runs with the installer's rights.

    ``celery-fence install`` runs exactly this text in a transaction; ``celery-fence install
    --print`` prints it between ``BEGIN`` and ``COMMIT``.
    """
    lines = [
        "-- celery-fence install script: safe to run again; applies only pending migrations.",
        "SET LOCAL search_path = pg_catalog, pg_temp;",
        "SET LOCAL lock_timeout = 0;",
        f"SELECT pg_advisory_xact_lock({INSTALL_LOCK_KEY});",
        f"SET LOCAL lock_timeout = '{milliseconds(lock_timeout)}';",
        read("bootstrap.sql").strip(),
        # A schema that a newer package upgraded is left alone: its tables may not fit the
        # functions below, which would replace that package's.
        f"DO $celery_fence_install$\nDECLARE\n"
        f"    v_version integer := (SELECT max(version) FROM celery_fence.migrations);\n"
        f"BEGIN\n    IF v_version > {latest_version()} THEN\n"
        f"        RAISE EXCEPTION 'celery_fence: the schema is at version %, newer than this "
        f"package''s latest ({latest_version()}); nothing was changed: install with the "
        f"celery-fence that upgraded it, or a newer one', v_version;\n"
        f"    END IF;\nEND\n$celery_fence_install$;",
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
