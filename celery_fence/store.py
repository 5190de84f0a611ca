"""LeaseStore: the Python face of the lease protocol that lives in PostgreSQL."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import select
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from datetime import datetime
from typing import Any, Literal, get_args
from uuid import UUID

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session, scoped_session

from celery_fence import _sql, validation
from celery_fence.exceptions import (
    ConfigurationError,
    FenceDatabaseError,
    FenceError,
    LeaseError,
    LeaseLostError,
    LeasePausedError,
    SchemaNotInstalledError,
    StaleEpochError,
)
from celery_fence.keeper import RENEWALS_AT_ONCE
from celery_fence.models import Acquisition, Dispatch, HistoryEntry, Lease, Owner, StaleRun
from celery_fence.observe import Metrics, log, stale_log

Clock = Callable[[], datetime]
Mode = Literal["join", "resume"]
Released = Literal["released", "left"]
#: The reasons a stale run is recorded for (the CHECK of ``celery_fence.stale_runs.reason``).
_STALE_REASONS = ("expired", "superseded", "released", "paused", "forged", "missing", "malformed")

# Where _cursor() keeps its cursor in a pooled connection's info.
_CURSOR_INFO = "celery_fence.cursor"
_LOCK_NOT_AVAILABLE = "55P03"
# The server ended a session left idle in a transaction past its idle limit, which a passed fence
# check sets to the time its lease has left (see celery_fence.fence).
_IDLE_IN_TRANSACTION_TIMEOUT = "25P03"
_STALE_EPOCH = "CF001"
_SERIALIZATION_FAILURE = "40001"
# The stale reason of a lease the check found no row for.
_MISSING = "missing"
# The savepoint a shadow-mode check runs in, inside the caller's transaction.
_SHADOW_SAVEPOINT = "celery_fence_shadow_check"
# What celery_fence.release() notifies, with the lease's name as payload.
_RELEASED_CHANNEL = "celery_fence_released"
#: A waiting acquisition looks again at least this often (seconds), notified or not: a lease
#: that runs out, rather than being released, sends no notification.
RECHECK_INTERVAL = 1.0
# Missing objects: the schema's when the message names one of its objects (``celery_fence.x``,
# schema "celery_fence"), else a plain database error (an operator or type the caller's own
# arguments asked for, say).
_SCHEMA_MISSING = {"3F000", "42P01", "42883", "42704"}
_SCHEMA_OBJECT = re.compile(r'(?<![\w"])"?celery_fence"?\.|schema "celery_fence"')
_INVALID_ARGUMENT = {"22023"}
_OWNER_FIELDS = tuple(field.name for field in dataclass_fields(Owner))


#: What :meth:`LeaseStore.guard` fences: a SQLAlchemy ``Connection`` or ``Session`` (or a
#: ``scoped_session``), on psycopg 3.
Executor = sa.Connection | Session | scoped_session[Session]


#: libpq connection parameters :func:`engine_from_url` sets unless the URL or ``connect_args``
#: give their own: a server that accepts the connection but never answers fails it in seconds,
#: and a peer gone silent (a partition, a host that died) is noticed, by TCP keepalives while
#: the call waits for an answer and by ``tcp_user_timeout`` (libpq 12 and later, on Linux) while
#: its request is unacknowledged, instead of leaving the call waiting, and its caller (a run's
#: end, the renewals of every lease in the process) with it, for as long as the kernel's
#: defaults allow (minutes to hours).
CONNECT_DEFAULTS: dict[str, int | str] = {
    # What pg_stat_activity and the server's log show for a session that names no application
    # (neither application_name nor PGAPPNAME).
    "fallback_application_name": "celery-fence",
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,
}
# The libpq version that knows tcp_user_timeout (an older one refuses it as unknown).
_TCP_USER_TIMEOUT_LIBPQ = 120_000


#: The libpq connection parameters a message must not show.
_SECRET_PARAMETERS = frozenset({"password", "sslpassword"})


def shown_url(url: str | sa.URL) -> str:
    """A database URL as messages show it: its password hidden, and libpq's ``password`` and
    ``sslpassword`` parameters too."""
    url = make_url(url)
    secrets = sorted(key for key in url.query if key.lower() in _SECRET_PARAMETERS)
    shown = url.difference_update_query(secrets).render_as_string(hide_password=True)
    hidden = "&".join(f"{key}=***" for key in secrets)
    return f"{shown}{'&' if '?' in shown else '?'}{hidden}" if secrets else shown


def engine_from_url(url: str, **kwargs: Any) -> Engine:
    """An engine on psycopg 3 for a ``postgresql://`` (or libpq's ``postgres://``) or
    ``postgresql+psycopg://`` URL, with :data:`CONNECT_DEFAULTS` for the connection parameters
    neither the URL nor ``connect_args`` gives."""
    try:
        parsed = make_url(url)
    except (sa.exc.ArgumentError, ValueError) as exc:
        raise ConfigurationError(
            "not a valid database URL (expected postgresql://user:password@host:port/database)"
        ) from exc
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() != "postgresql":
        raise ConfigurationError(f"celery-fence needs PostgreSQL, got {parsed.drivername!r}")
    try:
        if parsed.get_driver_name() == "psycopg":
            given = dict(kwargs.get("connect_args") or {})
            kwargs["connect_args"] = {**_connect_defaults(parsed), **given}
        return sa.create_engine(parsed, **kwargs)
    except (sa.exc.NoSuchModuleError, ImportError) as exc:
        raise ConfigurationError(f"no database driver for {parsed.drivername!r}: {exc}") from exc


def _connect_defaults(url: sa.URL) -> dict[str, int | str]:
    """:data:`CONNECT_DEFAULTS` that ``url`` (a psycopg URL) leaves unset and this libpq knows."""
    libpq = url.get_dialect().import_dbapi().pq.version()
    return {
        key: value
        for key, value in CONNECT_DEFAULTS.items()
        if key not in url.query and (key != "tcp_user_timeout" or libpq >= _TCP_USER_TIMEOUT_LIBPQ)
    }


def proof_message(name: str, epoch: int, holder: str, mode: Mode) -> bytes:
    """The bytes a header proof signs; ``celery_fence.proof_message`` builds the same."""
    return "\n".join((name, str(epoch), holder, mode)).encode()


def proof(lease: Lease, mode: Mode) -> str:
    """HMAC-SHA256 keyed by the lease's token: proves a header's origin without carrying it."""
    message = proof_message(lease.name, lease.epoch, lease.holder, mode)
    return hmac.new(lease.token.bytes, message, hashlib.sha256).hexdigest()


def _driver_error(exc: BaseException) -> BaseException:
    """The DB-API error itself, also when SQLAlchemy wrapped it."""
    orig = exc.orig if isinstance(exc, sa.exc.DBAPIError) else None
    return orig if orig is not None else exc


def _sqlstate(exc: BaseException) -> str | None:
    orig = _driver_error(exc)
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


def _wrap(exc: BaseException) -> FenceDatabaseError | ConfigurationError:
    state = _sqlstate(exc)
    detail = (str(_driver_error(exc)).strip().splitlines() or [type(exc).__name__])[0]
    if state in _SCHEMA_MISSING and _SCHEMA_OBJECT.search(detail):
        return SchemaNotInstalledError(
            f"celery-fence schema is not installed or out of date ({detail}); "
            "run `celery-fence install`"
        )
    if state in _INVALID_ARGUMENT:
        return ConfigurationError(detail)
    return FenceDatabaseError(f"database error: {detail}")


class _Statement:
    """A named query compiled once to the driver's parameter style, run on a DB-API cursor:
    the protocol's calls skip SQLAlchemy's per-statement compilation and row processing."""

    def __init__(self, sql: str, dialect: sa.Dialect) -> None:
        compiled = sa.text(sql).compile(dialect=dialect)
        self.sql = compiled.string
        self.positions = compiled.positiontup

    def parameters(self, values: Mapping[str, Any]) -> Mapping[str, Any] | tuple[Any, ...]:
        if self.positions:
            return tuple(values[name] for name in self.positions)
        return values


class _Connections:
    """The store's own autocommit DB-API connections for protocol calls. Each is opened as the
    engine opens its own (its creator, with ``connect_args`` and ``do_connect`` and ``connect``
    listeners), through a pool recreated from the engine's for it and left at once: a pool
    exhausted by the work never delays a protocol call. An idle connection waits with a cursor
    of its own, reused for every call, on a stack, the most recently used on top, at most
    ``keep`` of them; more are opened while all are busy, up to ``limit`` open at once, beyond
    which a caller waits up to ``timeout`` seconds for one to come back. A protocol call is one
    statement: a pool's checkout and reset, or a new cursor, would cost more than the rest of
    the call's client work. A forked child keeps its parent's connections referenced, unused
    and open, so that neither closing nor collecting them touches the parent's sessions, and
    opens its own."""

    def __init__(self, engine: Engine, *, keep: int, limit: int, timeout: float = 30.0) -> None:
        self._engine = engine
        self._dialect = engine.dialect
        # libpq's status of a session outside any transaction (psycopg's pq module).
        self._idle_status = engine.dialect.loaded_dbapi.pq.TransactionStatus.IDLE
        self._keep = keep
        self._limit = limit
        self._timeout = timeout
        self._inherited: list[Any] = []
        self._generation = 0
        self._start()
        _EVERY_STORES_CONNECTIONS.add(self)

    def _start(self) -> None:
        """No connection open yet; a new generation, so that one lent out before is not taken
        back."""
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)
        self._idle: list[Any] = []
        self._count = 0
        self._generation += 1

    def forked(self) -> None:
        """In a forked child: set the parent's connections aside and start afresh."""
        self._inherited.extend(self._idle)
        self._start()

    def _open(self) -> Any:
        # A pool of its own for each connection, made from the engine's as it is now (its creator
        # and listeners) and left at once: the engine's pool, its limits and its other
        # connections are never involved.
        pooled = self._engine.pool.recreate().connect()
        pooled.detach()
        connection = pooled.dbapi_connection
        assert connection is not None  # a connection just checked out is open
        try:
            self._dialect.set_isolation_level(connection, "AUTOCOMMIT")
            _read_in_full(connection)
        except BaseException:
            connection.close()
            raise
        return connection

    @contextmanager
    def unpooled(self) -> Iterator[Any]:
        """A connection of its own for the block, outside the stack and its limit; closed
        after."""
        connection = self._open()
        try:
            yield connection
        finally:
            connection.close()

    def checkout(self) -> tuple[Any, int]:
        """The cursor of an idle connection, or of one opened for the caller, and the generation
        to hand back with it to :meth:`checkin`."""
        with self._lock:
            if (
                not self._idle
                and self._count >= self._limit
                and not self._returned.wait_for(
                    lambda: self._idle or self._count < self._limit, self._timeout
                )
            ):
                raise FenceDatabaseError(
                    f"all {self._limit} protocol connections stayed busy for {self._timeout:g} s"
                )
            generation = self._generation
            cursor = self._idle.pop() if self._idle else None
            if cursor is None:
                self._count += 1
        if cursor is not None:
            if _quiet(cursor.connection):
                return cursor, generation
            # Ended by the server while it waited (a terminated backend, an idle session
            # timeout, a restart): opened anew in its place.
            cursor.connection.close()
        try:
            return self._open().cursor(), generation
        except BaseException:
            self._gone()
            raise

    def checkin(self, cursor: Any, generation: int) -> None:
        connection = cursor.connection
        if generation != self._generation:  # forked while it was out: the parent's to keep
            self._inherited.append(cursor)
            return
        # One closed or broken, left in a statement or a transaction (an exception raised into
        # the call, such as a soft time limit), or out of autocommit by a borrower is not handed
        # out again.
        if connection.autocommit and connection.pgconn.transaction_status == self._idle_status:
            with self._lock:
                if len(self._idle) < self._keep:
                    self._idle.append(cursor)
                    self._returned.notify()
                    return
        self._gone()
        connection.close()

    def _gone(self) -> None:
        with self._lock:
            self._count -= 1
            self._returned.notify()

    @contextmanager
    def connection(self) -> Iterator[Any]:
        cursor, generation = self.checkout()
        try:
            yield cursor.connection
        finally:
            self.checkin(cursor, generation)

    def close(self, *, close: bool = True) -> None:
        """Close the idle connections; ``close=False`` sets them aside instead."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._returned.notify_all()
        if not close:
            self._inherited.extend(idle)
            return
        for cursor in idle:
            cursor.connection.close()


def _read_in_full(connection: Any) -> None:
    """Set what a role, a database or the environment (PGDATESTYLE, PGOPTIONS) may have set
    otherwise for the session: psycopg reads times only in the ISO date style, and a lease's
    remaining seconds, a float sent as text, must keep every digit. A session that needs
    neither is left as it is."""
    settings = []
    if not (connection.info.parameter_status("DateStyle") or "ISO").startswith("ISO"):
        settings.append("SET DateStyle = ISO")
    (digits,) = connection.execute("SHOW extra_float_digits").fetchone()
    if int(digits) < 1:
        settings.append("SET extra_float_digits = 3")
    if settings:
        connection.execute("; ".join(settings))


def _quiet(connection: Any) -> bool:
    """Whether an idle protocol connection has nothing to read. It listens to no channel and
    sends no query, so anything the server sent it since (the error that ends a terminated
    session, before the socket closes) means it is not to be used again, as does a connection
    closed or found broken before."""
    if connection.closed or connection.broken:
        return False
    socket = connection.pgconn.socket
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(socket, select.POLLIN)
        return not poller.poll(0)
    readable, _, _ = select.select([socket], [], [], 0)
    return not readable


def _refuse_ended(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    """A pool checkout listener: a pooled connection the server ended while it was idle is
    discarded, and the pool hands out another (SQLAlchemy's ``DisconnectionError`` protocol),
    as ``pool_pre_ping`` would, without its round trip. A silent network drop leaves nothing to
    read: ``pool_pre_ping`` still covers that."""
    if not _quiet(dbapi_connection):
        raise sa.exc.DisconnectionError("the server ended this connection while it was idle")


# Every store's connections, so that a forked child sets its parent's aside before any use.
_EVERY_STORES_CONNECTIONS: weakref.WeakSet[_Connections] = weakref.WeakSet()


# The Connections and Sessions inside guard blocks, each with how many: their commits are refused.
_GUARDED: weakref.WeakKeyDictionary[sa.Connection | Session, int] = weakref.WeakKeyDictionary()
# The engines whose Connections' commits, statements and rollbacks guard blocks watch, and those
# whose transactions' ends are watched (listened to once each), and whether the Sessions' commits
# are.
_WATCHED_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()
_ENDS_WATCHED_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()
_watching_sessions = False
_WATCH_LOCK = threading.Lock()
# The fence checks passed in each Connection's current transaction (the store that checked, the
# lease, the action): each left the transaction an idle limit that ends its session at the
# lease's expiry.
_Checked = tuple["LeaseStore", Lease, str]
_CHECKED: weakref.WeakKeyDictionary[sa.Connection, list[_Checked]] = weakref.WeakKeyDictionary()


class _Block:
    """What a guard block has seen of its transaction's statements: whether one ran since the
    transaction began (or rolled back), and the savepoints SQLAlchemy opened in the block and
    has not closed yet. On a Session, also the nested transactions open when the block began (a
    Session emits the savepoint of one begun in the block only at its next statement), and the
    savepoints the Session opened as it began a transaction (``sessions_own``: its own nested
    transactions, which it tells of, and the savepoint a Session joined to an outer transaction
    keeps on the Connection)."""

    def __init__(self, guarded: sa.Connection | Session) -> None:
        self.ran = False
        self.savepoints: list[str] = []
        self.sessions_own: set[str] = set()
        self.nested: list[Any] = []
        if isinstance(guarded, Session):
            transaction = guarded.get_nested_transaction()
            while transaction is not None:
                self.nested.append(transaction)
                transaction = transaction.parent


# The guard blocks open on each Connection, innermost last; a Session's blocks, which follow it
# to the Connection it begins a transaction on after a rollback.
_BLOCKS: weakref.WeakKeyDictionary[sa.Connection, list[_Block]] = weakref.WeakKeyDictionary()
_SESSION_BLOCKS: weakref.WeakKeyDictionary[Session, list[_Block]] = weakref.WeakKeyDictionary()
# The savepoint a Connection in guard blocks opened with its latest statement, if that was one.
_OPENED: weakref.WeakKeyDictionary[sa.Connection, str] = weakref.WeakKeyDictionary()
# The statements that end or split a transaction, by their first word (and second).
_TRANSACTION_CONTROL = frozenset(
    {"COMMIT", "END", "ROLLBACK", "ABORT", "SAVEPOINT", "RELEASE", "PREPARE TRANSACTION"}
)
_WORD = re.compile(r"[A-Za-z]+")
_LINE_END = re.compile(r"[\r\n]")
# PostgreSQL's identifier characters: an ASCII letter, _ or any character from U+0080 on
# first, then digits too, and $ (which a dollar quote's tag takes none of).
_NAME_START = r"A-Za-z_\x80-\U0010ffff"
_NAME_PART = r"A-Za-z0-9_\x80-\U0010ffff"
# What the statements of a string are told apart by: words (identifiers and keywords), dollar
# quotes, semicolons, quotes and comments.
_TOKEN = re.compile(
    rf"(?P<word>[{_NAME_START}][{_NAME_PART}$]*)"
    rf"|(?P<dollar>\$(?:[{_NAME_START}][{_NAME_PART}]*)?\$)"
    r"""|(?P<mark>[;'"().]|--|/\*)"""
)
_COMMENT_MARK = re.compile(r"/\*|\*/")
# Two string constants with only whitespace and a newline between them (comments allowed) are
# one, which goes on in the first one's way: an E'' string's backslashes still escape.
_CONTINUATION = re.compile(r"(?:[ \t\f\v]|--[^\n\r]*)*[\n\r](?:[ \t\n\r\f\v]|--[^\n\r]*[\n\r])*'")
# A statement whose body can hold semicolons outside quotes: BEGIN ATOMIC ... END.
_ROUTINE = frozenset({("CREATE", "FUNCTION"), ("CREATE", "PROCEDURE")})


def _past_comments(statement: str, at: int) -> int:
    """Where ``statement`` goes on after the whitespace and comments at ``at`` (``--`` to the
    end of the line, ``/* */`` nested as PostgreSQL nests them)."""
    end = len(statement)
    while at < end:
        if statement[at] in " \t\n\r\f\v":
            at += 1
        elif statement.startswith("--", at):
            # To the end of the line, which a carriage return ends too.
            line_end = _LINE_END.search(statement, at)
            at = end if line_end is None else line_end.end()
        elif statement.startswith("/*", at):
            depth, at = 1, at + 2
            while depth:
                mark = _COMMENT_MARK.search(statement, at)
                if mark is None:
                    return end
                depth += 1 if mark.group() == "/*" else -1
                at = mark.end()
        else:
            break
    return at


def _past_quoted(sql: str, at: int, quote: str, backslashes: bool = False) -> int:
    """Where ``sql`` goes on after the quoted text from ``at`` (just past its opening
    ``quote``): a doubled quote stands for one, and with ``backslashes`` a backslash escapes
    the character after it. The end of ``sql`` when the quote is not closed."""
    close = -1
    while True:
        if close < at:
            close = sql.find(quote, at)
            if close < 0:
                return len(sql)
        slash = sql.find("\\", at, close) if backslashes else -1
        if slash >= 0:
            at = slash + 2
        elif sql.startswith(quote, close + 1):
            at = close + 2
        else:
            return close + 1


def _past_string(sql: str, at: int, backslashes: bool) -> int:
    """Where ``sql`` goes on after the string constant from ``at`` (just past its opening
    quote), continued on later lines as PostgreSQL continues one."""
    while True:
        at = _past_quoted(sql, at, "'", backslashes)
        more = _CONTINUATION.match(sql, at)
        if more is None:
            return at
        at = more.end()


def _statement_starts(sql: str, *, backslashes: bool = False) -> Iterator[int]:
    """Where each statement of ``sql`` begins: at 0, and after every semicolon that is not
    inside a quoted string, a quoted identifier, a dollar-quoted string, a comment or the
    ``BEGIN ATOMIC ... END`` body of a ``CREATE FUNCTION`` or ``PROCEDURE``. A backslash escapes
    in ``E''`` strings, and with ``backslashes`` (``standard_conforming_strings`` off) in every
    string. Raises :class:`ConfigurationError` for SQL whose body does not end where a statement
    could: its statements cannot be told apart."""
    yield 0
    at, end = 0, len(sql)
    words: list[str] = []  # the statement's first words, OR REPLACE left out
    depth = 0  # of a routine's BEGIN ATOMIC body, and of the CASE expressions inside it
    parentheses = 0
    named = False  # the last token was AS or a dot: the word after it is a name, not a keyword
    while at < end and (token := _TOKEN.search(sql, at)) is not None:
        text, at = token.group(), token.end()
        after_name, named = named, False
        if token.lastgroup == "word":
            word = text.upper()
            if len(words) < 2 and not (words == ["CREATE"] and word in ("OR", "REPLACE")):
                words.append(word)
            if not after_name and not parentheses and tuple(words) in _ROUTINE:
                # The body opens with BEGIN ATOMIC; a CASE inside it ends with an END too.
                if depth:
                    opens = word == "CASE"
                else:
                    opens = word == "BEGIN" and _first_words(sql, at)[0] == "ATOMIC"
                if opens:
                    depth += 1
                elif word == "END" and depth:
                    depth -= 1
            named = word == "AS"
            if word == "E" and sql.startswith("'", at):
                at = _past_string(sql, at + 1, backslashes=True)
        elif token.lastgroup == "dollar":
            close = sql.find(text, at)
            at = end if close < 0 else close + len(text)
        elif text == ";":
            if not depth:
                words, parentheses = [], 0
                yield at
        elif text == "(":
            parentheses += 1
        elif text == ")":
            parentheses = max(parentheses - 1, 0)
        elif text == ".":
            # Between the parts of a qualified name (t.end, t . end), not in a number (1.5).
            named = not sql[token.start() - 1 : token.start()].isdigit()
        elif text in ("--", "/*"):
            at = _past_comments(sql, token.start())
            named = after_name
        elif text == "'":
            at = _past_string(sql, at, backslashes)
        else:
            at = _past_quoted(sql, at, '"')
    if depth:
        raise ConfigurationError(
            "SQL refused inside a guard block: a BEGIN ATOMIC body of its CREATE FUNCTION or "
            "PROCEDURE has no END where a statement could end, so its statements cannot be "
            "told apart; send them one at a time"
        )


def _escapes_everywhere(cursor: Any) -> bool:
    """Whether a backslash escapes in every string of SQL sent on DB-API ``cursor``: its
    session has ``standard_conforming_strings`` off."""
    info = getattr(cursor.connection, "info", None)
    return info is not None and info.parameter_status("standard_conforming_strings") == "off"


def _first_words(statement: str, at: int = 0) -> tuple[str, str]:
    """The first word of ``statement`` from ``at`` and the one after it, upper case (``""``
    for none), past the whitespace and comments before each."""
    words: list[str] = []
    for _ in range(2):
        word = _WORD.match(statement, _past_comments(statement, at))
        if word is None:
            break
        words.append(word.group().upper())
        at = word.end()
    words += ["", ""]
    return words[0], words[1]


def _watch_statement(
    conn: sa.Connection, cursor: Any, statement: str, _parameters: Any, context: Any, _many: Any
) -> None:
    """A ``before_cursor_execute`` listener for the guard blocks open on ``conn``: SQLAlchemy's
    own savepoints are followed as they open and close; any other SQL of which a statement
    would end or split the transaction (``COMMIT``, ``ROLLBACK``, ``SAVEPOINT``, ...), the first
    or one after it (``UPDATE ...; COMMIT; BEGIN``), is refused before it runs, as a commit is;
    the rest are noted as run."""
    blocks = _BLOCKS.get(conn)
    if not blocks:
        return
    clause = getattr(getattr(context, "compiled", None), "statement", None)
    _OPENED.pop(conn, None)
    if isinstance(clause, sa.sql.elements.SavepointClause):
        for block in blocks:
            block.savepoints.append(clause.ident)
        _OPENED[conn] = clause.ident
        return
    if isinstance(
        clause, (sa.sql.elements.ReleaseSavepointClause, sa.sql.elements.RollbackToSavepointClause)
    ):
        # Closed, with the savepoints opened inside it.
        for block in blocks:
            if clause.ident in block.savepoints:
                del block.savepoints[block.savepoints.index(clause.ident) :]
        return
    starts: Iterable[int] = (0,)
    if ";" in statement:
        starts = _statement_starts(statement, backslashes=_escapes_everywhere(cursor))
    for start in starts:
        first, second = _first_words(statement, start)
        control = f"{first} {second}" if first == "PREPARE" else first
        if control in _TRANSACTION_CONTROL:
            raise ConfigurationError(
                f"{control} refused inside a guard block: the fence check runs in the block's "
                "transaction when the block ends; commit after the block, and use SQLAlchemy's "
                "begin_nested() for savepoints"
            )
    for block in blocks:
        block.ran = True


def _rolled_back(conn: sa.Connection) -> None:
    """The transaction rolled back through SQLAlchemy: what the blocks' statements wrote is
    gone, and with it any savepoint."""
    for block in _BLOCKS.get(conn, ()):
        block.ran = False
        block.savepoints.clear()


def _session_began(session: Session, _transaction: Any, connection: sa.Connection) -> None:
    """An ``after_begin`` listener: a Session in guard blocks begins a transaction on a
    Connection (after a rollback, another one): its blocks watch that one's statements. A
    savepoint it opened to begin it is the Session's own."""
    blocks = _SESSION_BLOCKS.get(session)
    if blocks:
        _BLOCKS[connection] = blocks
        opened = _OPENED.pop(connection, None)
        if opened is not None:
            for block in blocks:
                block.sessions_own.add(opened)


def _checked_connection(
    block: _Block, guarded: sa.Connection | Session, action: str
) -> sa.Connection:
    """The Connection whose transaction the check of ``block`` is to run in. Refused: a block
    whose check would run inside a savepoint the block opened and left open, which a rollback
    to it after the block would undo, locks and all, or whose transaction ended inside the
    block past SQLAlchemy (the DB-API connection's ``commit()``, a ``COMMIT`` sent on a DB-API
    cursor of its own), so that what it wrote before was not fenced."""
    nested = guarded.get_nested_transaction() if isinstance(guarded, Session) else None
    left_open = [ident for ident in block.savepoints if ident not in block.sessions_own]
    if left_open or not (nested is None or any(nested is t for t in block.nested)):
        raise ConfigurationError(
            f"guard block for {action!r} left a nested transaction (savepoint) open: the fence "
            "check would run inside it, and a rollback to it after the block would release the "
            "check's locks; close nested transactions inside the block"
        )
    # A block that rolled its transaction back may end on a Session's new connection.
    connection = _connection(guarded)
    status = _cursor(connection).connection.info.transaction_status
    if block.ran and status == type(status).IDLE:
        raise ConfigurationError(
            f"guard block for {action!r}: its transaction ended inside the block, past "
            "SQLAlchemy (a commit of the DB-API connection, or a COMMIT sent on a DB-API cursor), "
            "so what it wrote before was not fenced; commit after the block"
        )
    return connection


def _commit_refused() -> ConfigurationError:
    return ConfigurationError(
        "commit refused inside a guard block: the fence check runs when the block ends, so the "
        "writes would commit unchecked; commit after the block"
    )


def _refuse_commit(conn: sa.Connection, *_: Any) -> None:
    """Refuse the commit (or two-phase prepare) of a Connection inside a guard block. SQLAlchemy
    counts a commit that raised as the transaction's end, and hands the connection back to its
    pool without a rollback: the writes are rolled back here, so that none stay pending on it (a
    connection too broken to roll back commits nothing either)."""
    if _GUARDED.get(conn) or _BLOCKS.get(conn):
        dbapi_connection = conn.connection.dbapi_connection
        if dbapi_connection is not None:
            with suppress(conn.dialect.loaded_dbapi.Error):
                dbapi_connection.rollback()
        raise _commit_refused()


def _refuse_session_commit(session: Session) -> None:
    """Refuse the commit of a Session inside a guard block, whichever connections it uses by
    then; a savepoint's release commits nothing and goes through. The transaction is left as it
    was, so that the check at the block's end still fences it."""
    if _GUARDED.get(session) and not session.in_nested_transaction():
        raise _commit_refused()


def _listen_once(
    engine: Engine, watched: weakref.WeakSet[Engine], *listeners: tuple[str, Callable[..., Any]]
) -> None:
    """Listen to ``engine``'s events with ``listeners`` (event name, function) unless it is in
    ``watched`` already; then it is."""
    if engine not in watched:
        with _WATCH_LOCK:
            if engine not in watched:
                for event, listener in listeners:
                    # Engines made by execution_options() share their dialect, where some
                    # events (handle_error) are kept.
                    if not sa.event.contains(engine, event, listener):
                        sa.event.listen(engine, event, listener)
                watched.add(engine)


def _watch_block(guarded: sa.Connection | Session, connection: sa.Connection) -> None:
    """Have what guard blocks watch seen by them: the commits, statements and rollbacks of
    ``connection``'s engine (a Session's connection's too) and, for a Session, the Sessions'
    commits and the transactions they begin (see :class:`_Block`)."""
    global _watching_sessions
    if isinstance(guarded, Session) and not _watching_sessions:
        with _WATCH_LOCK:
            if not _watching_sessions:
                sa.event.listen(Session, "before_commit", _refuse_session_commit)
                sa.event.listen(Session, "after_begin", _session_began)
                _watching_sessions = True
    _listen_once(
        connection.engine,
        _WATCHED_ENGINES,
        ("commit", _refuse_commit),
        ("prepare_twophase", _refuse_commit),
        ("before_cursor_execute", _watch_statement),
        ("rollback", _rolled_back),
    )


def _forget_checks(conn: sa.Connection, *_: Any) -> None:
    """A transaction begins or rolls back on ``conn``, or a savepoint rolls back (which restores
    the idle limit in force before it): no check before that is known to apply."""
    _CHECKED.pop(conn, None)


def _ended_idle(context: sa.engine.ExceptionContext) -> None:
    """A ``handle_error`` listener: the commit or statement of a transaction whose session the
    server ended for idling past a checked lease's expiry raises the rejection of its fenced
    writes (see :meth:`LeaseStore.guard`) in place of the driver's error."""
    conn = context.connection
    if conn is None or _sqlstate(context.original_exception) != _IDLE_IN_TRANSACTION_TIMEOUT:
        return
    rejection = _idle_rejection(_CHECKED.pop(conn, []))
    if rejection is not None:
        raise rejection


def _idle_rejection(checked: list[_Checked]) -> StaleEpochError | None:
    """The rejection of the writes fenced by ``checked`` in a transaction the server ended for
    idling: every lease among them judged stale now is recorded, and the first one's error
    returned; ``None`` while all still hold (the session's own idle limit, shorter than theirs,
    ended it) or when none can be judged."""
    rejection = None
    judged = set()
    for store, lease, action in checked:
        key = (store, lease.name, lease.epoch)
        if key in judged:  # one record for each lease, however many guard blocks fenced it
            continue
        judged.add(key)
        error = store._rejected_after_idling(lease, action)
        rejection = rejection or error
    return rejection


def _after_fork_in_child() -> None:
    for connections in list(_EVERY_STORES_CONNECTIONS):
        connections.forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _a_lease(value: object, what: str) -> Lease:
    """``value`` if it is a :class:`Lease` whose fields have the types an acquisition gives
    them, else the error ``what`` (the call) raises."""
    if not isinstance(value, Lease):
        raise ConfigurationError(
            f"{what} needs a Lease (an acquisition's .lease), got {_qualified(value)}"
        )
    validation.check_epoch(value.epoch)
    for field, text in (("name", value.name), ("holder", value.holder)):
        if not isinstance(text, str) or not text or "\x00" in text:
            raise ConfigurationError(f"{what}: the lease's {field} must be text, got {text!r}")
    if not isinstance(value.token, UUID):
        raise ConfigurationError(f"{what}: the lease's token must be a UUID")
    if value.sharer is not None:
        validation.check_text(
            value.sharer, f"{what}: the lease's sharer", max_length=validation.MAX_NAME_LENGTH
        )
    if value.joined_at is not None:
        validation.check_aware(value.joined_at, f"{what}: the lease's joined_at")
    return value


def _qualified(value: object) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def _guarded(conn: Executor) -> sa.Connection | Session:
    """What a guard block on ``conn`` watches the commits of: the Session (a scoped session's
    current one), or the Connection."""
    return conn() if isinstance(conn, scoped_session) else conn


def _connection(conn: sa.Connection | Session) -> sa.Connection:
    """The SQLAlchemy ``Connection`` under ``conn``, in a transaction SQLAlchemy knows of: a
    Session's (begun if none is, as its next statement would), or the Connection's own (begun
    here if none is, likewise), so that the fence check never opens one behind SQLAlchemy's
    back."""
    if isinstance(conn, Session):
        several = ConfigurationError(
            "guard cannot tell which of the Session's engines the writes go to; pass the "
            "Session's connection for them, session.connection(bind_arguments={'mapper': "
            "Model})"
        )
        # binds= as the Session keeps them (``binds`` from SQLAlchemy 2.1, a private attribute
        # before): with engines other than its default bind, its connection() is the default's
        # alone.
        binds = getattr(conn, "binds", None) or getattr(conn, "_Session__binds", None) or {}
        engines = {bind.engine for bind in (*binds.values(), conn.bind) if bind is not None}
        if len(engines) > 1:
            raise several
        try:
            conn = conn.connection()
        except sa.exc.UnboundExecutionError as exc:
            raise several from exc
    elif not isinstance(conn, sa.Connection):
        raise ConfigurationError(
            f"guard needs a SQLAlchemy Connection or Session, got {_qualified(conn)}"
        )
    if conn.dialect.driver != "psycopg":
        raise ConfigurationError(
            "guard needs a connection through psycopg 3 (an engine on a postgresql+psycopg:// "
            f"URL), got {conn.dialect.name}+{conn.dialect.driver}"
        )
    if not conn.in_transaction():
        conn.begin()
    return conn


def _cursor(conn: sa.Connection) -> Any:
    """A DB-API cursor on the connection under a SQLAlchemy ``Connection``, in its current
    transaction. It is kept in the connection's ``info``, which SQLAlchemy discards with the
    DB-API connection, and reused by every later call on it."""
    pooled = conn.connection
    cursor = pooled.info.get(_CURSOR_INFO)
    if cursor is None:
        dbapi_connection = pooled.dbapi_connection
        assert dbapi_connection is not None  # a connection in use is open
        cursor = pooled.info[_CURSOR_INFO] = dbapi_connection.cursor()
    return cursor


def _read_committed(connection: Any) -> bool:
    """Whether a psycopg connection's transactions run at READ COMMITTED, as far as the driver
    knows (its own setting, else the server's default, taken as PostgreSQL's)."""
    level = connection.isolation_level
    return level is None or level == type(level).READ_COMMITTED


def _kept_waiting(error: FenceDatabaseError) -> bool:
    """Whether ``error`` ended a call that waited past its lock timeout for a lock."""
    return error.__cause__ is not None and _sqlstate(error.__cause__) == _LOCK_NOT_AVAILABLE


def _owner_of(rows: list[dict[str, Any]]) -> Owner | None:
    """The owner ``celery_fence.owner()`` answered."""
    return _owner(rows[0]) if rows else None


def _owner(row: Mapping[str, Any]) -> Owner | None:
    if row["name"] is None:
        return None
    return Owner(**{key: row[key] for key in _OWNER_FIELDS})


class LeaseStore:
    """Leases, fenced writes and stale-run records in one PostgreSQL database.

    ``engine`` is a SQLAlchemy engine on psycopg 3. ``clock`` replaces the database clock (tests
    pass a function returning an aware ``datetime``); by default ``clock_timestamp()`` decides.
    ``max_ttl`` bounds every TTL this store asks for. ``lock_timeout`` bounds how long an
    acquisition waits behind fenced writers before it answers "busy" (a renewal, a release, a
    pause or a resume, before it raises). ``safety_margin`` is the share of each granted period
    the holder does not trust, so that it stops before the database could hand the lease on.
    Protocol calls (acquire, renew, release, reads) run in autocommit on connections of the
    store's own, opened as ``engine`` opens its own (outside its pool): up to ``pool_size`` kept
    open between calls, up to ``max_connections`` (by default twice as many) at once. Fenced
    writes run on the caller's connection.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        clock: Clock | None = None,
        max_ttl: float = 3600.0,
        lock_timeout: float = 2.0,
        safety_margin: float = 0.1,
        default_environment: str = "default",
        pool_size: int = 5,
        max_connections: int | None = None,
    ) -> None:
        if not isinstance(engine, Engine):
            raise ConfigurationError(
                f"LeaseStore needs a SQLAlchemy Engine, got {_qualified(engine)} (a URL goes to "
                "LeaseStore.from_url)"
            )
        if clock is not None and not callable(clock):
            raise ConfigurationError(f"clock must be callable, got {_qualified(clock)}")
        self.engine = engine
        self.clock = clock
        self.max_ttl = validation.check_seconds(
            max_ttl, "max_ttl", maximum=validation.MAX_TTL_SECONDS
        )
        self.lock_timeout = validation.check_lock_timeout(lock_timeout, "lock_timeout")
        self.safety_margin = validation.check_fraction(safety_margin, "safety_margin")
        self.default_environment = validation.check_environment(default_environment)
        self.metrics = Metrics()
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise ConfigurationError(f"pool_size must be a positive integer, got {pool_size!r}")
        if max_connections is None:
            max_connections = 2 * pool_size
        elif (
            isinstance(max_connections, bool)
            or not isinstance(max_connections, int)
            or max_connections < pool_size
        ):
            raise ConfigurationError(
                f"max_connections must be an integer of at least pool_size ({pool_size}), got "
                f"{max_connections!r}"
            )
        # psycopg's async dialect names the same driver: its engine fails only at the first call.
        if engine.dialect.driver != "psycopg" or engine.dialect.is_async:
            raise ConfigurationError(
                "celery-fence needs psycopg 3 without asyncio (postgresql+psycopg://), got "
                f"{engine.url.drivername}"
            )
        if not sa.event.contains(engine, "checkout", _refuse_ended):
            sa.event.listen(engine, "checkout", _refuse_ended)
        self._connections = _Connections(engine, keep=pool_size, limit=max_connections)
        weakref.finalize(self, self._connections.close)
        self._statements = {
            name: _Statement(sql, engine.dialect) for name, sql in _sql.queries().items()
        }
        # What a protocol call can fail with: the driver's errors, and SQLAlchemy's wrapping of
        # them (opening a connection runs the dialect's first queries through SQLAlchemy).
        self._driver_errors: tuple[type[Exception], ...] = (
            engine.dialect.loaded_dbapi.Error,
            sa.exc.DBAPIError,
        )
        # Whether this store found the schema at its package's version, which its first protocol
        # call makes sure of: a package upgraded without `celery-fence install` is told so
        # before it calls functions of an older schema.
        self._schema_checked = False

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> LeaseStore:
        """A store on a new engine; ``postgresql://`` URLs use psycopg 3."""
        return cls(engine_from_url(url), **kwargs)

    def dedicated(self, *, max_connections: int = RENEWALS_AT_ONCE) -> LeaseStore:
        """A store with the same settings on connections of its own (one kept between calls, up
        to ``max_connections`` at once), for renewals, so that a busy pool in the work never
        starves the lease."""
        return LeaseStore(
            self.engine,
            pool_size=1,
            max_connections=max_connections,
            clock=self.clock,
            max_ttl=self.max_ttl,
            lock_timeout=self.lock_timeout,
            safety_margin=self.safety_margin,
            default_environment=self.default_environment,
        )

    @contextmanager
    def begin(self) -> Iterator[sa.Connection]:
        """A transaction on the store's engine, as ``engine.begin()``: committed when the block
        ends, rolled back if it raises. Failing to open it (no connection from the engine's pool
        within its ``pool_timeout``, the database unreachable) raises
        :class:`FenceDatabaseError`; what the block and its commit raise is raised as it is."""
        with ExitStack() as opened:
            try:
                conn = opened.enter_context(self.engine.begin())
            except (sa.exc.TimeoutError, sa.exc.DBAPIError) as exc:
                raise _wrap(exc) from exc
            yield conn

    @contextmanager
    def protocol_connection(self) -> Iterator[Any]:
        """One of the store's own autocommit DB-API (psycopg) connections, for the block."""
        with self._connections.connection() as connection:
            yield connection

    def dispose(self, *, close: bool = True) -> None:
        """Dispose of the store's own connections and the engine's (``close=False`` after a
        fork, so the parent's connections are left alone)."""
        self._connections.close(close=close)
        self.engine.dispose(close=close)

    # -- schema -----------------------------------------------------------------------------

    @staticmethod
    def install_script(*, lock_timeout: float = 2.0) -> str:
        """The SQL :meth:`install` runs, between ``BEGIN`` and ``COMMIT``, for review or for
        ``psql -f``: one transaction, whose locks each wait at most ``lock_timeout`` seconds."""
        lock_timeout = validation.check_lock_timeout(lock_timeout, "lock_timeout")
        return f"BEGIN;\n\n{_sql.install_script(lock_timeout)}\nCOMMIT;\n"

    def install(self) -> int:
        """Create or upgrade the schema (idempotent); return the schema version. Its locks each
        wait at most ``lock_timeout``: past it (a migration's table is in use), nothing changes
        and :class:`FenceDatabaseError` says so."""
        try:
            with self.engine.begin() as conn:
                # Executed without parameters, so the script's '%' stay literal; through
                # SQLAlchemy, so that a driver error is wrapped like any other.
                conn.exec_driver_sql(
                    _sql.install_script(self.lock_timeout),
                    execution_options={"no_parameters": True},
                )
                (row,) = self._run(_cursor(conn), "schema_version", {})
                self._schema_checked = True
                return int(row["version"])
        except self._driver_errors as exc:
            if _sqlstate(exc) == _LOCK_NOT_AVAILABLE:
                raise FenceDatabaseError(
                    "install changed nothing: a lock it needs was held past lock_timeout "
                    f"({self.lock_timeout:g}s), by sessions using celery-fence's tables (an open "
                    "fenced transaction, say); run it again"
                ) from exc
            raise _wrap(exc) from exc

    def check_schema(self, *, name_database: bool = True) -> int:
        """Return the installed schema version; raise :class:`SchemaNotInstalledError` when the
        schema is missing or older than this package's migrations. Its errors (those of a
        database it cannot reach too) name the database: its URL as :func:`shown_url` shows
        it, passwords hidden; ``name_database=False`` leaves it out, for a caller that names
        the database itself. A lock on the migrations table (a concurrent install's) keeps it
        waiting no longer than ``lock_timeout``: then :class:`FenceDatabaseError`."""
        try:
            rows = self._rows("schema_version", {}, lock_timeout=self.lock_timeout)
            version = rows[0]["version"] if rows else None
            if version is None or version < _sql.latest_version():
                raise SchemaNotInstalledError(
                    f"celery-fence schema is at version {version}, this package needs "
                    f"{_sql.latest_version()}; run `celery-fence install`"
                )
        except FenceDatabaseError as exc:
            if not name_database:
                raise
            exc.database = shown_url(self.engine.url)
            raise
        self._schema_checked = True
        return int(version)

    # -- the protocol -----------------------------------------------------------------------

    def acquire(
        self,
        name: str,
        *,
        holder: str,
        ttl: float,
        environment: str | None = None,
        max_hold: float | None = None,
        purpose: str = "",
        wait: float = 0,
    ) -> Acquisition:
        """Try to take the lease. Raises :class:`LeasePausedError` on a paused lease.

        ``acquired`` is true only for the winner, whose lease carries a new epoch. A loser's
        ``owner`` is the current owner as committed at the moment of the decision; ``outcome``
        is ``"busy"`` when fenced writers kept the row locked past ``lock_timeout``.

        ``wait`` (seconds) keeps trying that long while the lease is held or busy, and answers
        the last try when the time is up: the holder's release wakes the waiter at once (it
        listens on ``celery_fence_released``, on a connection of its own opened for the wait),
        and it looks again when the owner's lease runs out by the database clock, and at least
        every ``RECHECK_INTERVAL`` seconds.
        """
        params, wait = self.check_acquisition(
            name,
            holder=holder,
            ttl=ttl,
            environment=environment,
            max_hold=max_hold,
            purpose=purpose,
            wait=wait,
        )
        if wait:
            return self._acquire_waiting(params, time.monotonic() + wait)
        return self._acquire_once(params)

    def check_acquisition(
        self,
        name: str,
        *,
        holder: str,
        ttl: float,
        environment: str | None = None,
        max_hold: float | None = None,
        purpose: str = "",
        wait: float = 0,
    ) -> tuple[dict[str, Any], float]:
        """Check :meth:`acquire`'s arguments without reaching the database, raising
        :class:`ConfigurationError` for what it would refuse (for a caller that waits before it
        acquires, as ``celery-fence acquire --start-barrier`` does): the call's parameters and
        its ``wait``."""
        ttl_seconds = self._ttl(ttl)
        params = {
            "name": validation.check_name(name),
            "holder": validation.check_holder(holder),
            "environment": self._environment(environment),
            "ttl": ttl_seconds,
            "max_hold": self._max_hold(max_hold, ttl_seconds),
            "purpose": validation.check_text(
                purpose, "purpose", max_length=validation.MAX_TEXT_LENGTH, allow_empty=True
            ),
            "lock_timeout": self.lock_timeout,
            "now": self._now(),
        }
        wait = validation.check_seconds_or_zero(wait, "wait", maximum=validation.MAX_HOLD_SECONDS)
        return params, wait

    def _acquire_once(self, params: Mapping[str, Any]) -> Acquisition:
        """One acquisition, with the parameters :meth:`check_acquisition` made."""
        name = params["name"]
        started = time.monotonic()
        try:
            row = self._call("acquire", params)
        except FenceDatabaseError as exc:
            return self._busy(name, exc, "acquire", params["lock_timeout"])
        outcome = row["outcome"]
        self.metrics.incr(f"acquire.{outcome}")
        owner = _owner(row)
        if outcome == "paused":
            assert owner is not None
            raise LeasePausedError(
                f"lease {name} is paused by {owner.paused_by}: {owner.paused_reason}",
                lease_name=name,
                owner=owner,
                reason="paused",
            )
        lease = self._lease(row, started, params["ttl"]) if outcome == "acquired" else None
        if lease is not None:
            log.info(
                "lease %s acquired by %s at epoch %d",
                name,
                lease.holder,
                lease.epoch,
                extra={"lease": name, "epoch": lease.epoch, "holder": lease.holder},
            )
        remaining = None if owner is None else float(row["remaining"])
        return Acquisition(outcome=outcome, lease=lease, owner=owner, expires_in=remaining)

    def _acquire_waiting(self, params: Mapping[str, Any], deadline: float) -> Acquisition:
        """Acquire until ``deadline`` (``time.monotonic()``); a lock wait takes no more than
        what is left."""

        def attempt() -> Acquisition:
            left = max(deadline - time.monotonic(), 0.001)
            bounded = {**params, "lock_timeout": min(self.lock_timeout, left), "now": self._now()}
            return self._acquire_once(bounded)

        got = attempt()
        if got.acquired or time.monotonic() >= deadline:
            return got
        while True:
            listening = False
            try:
                with self._connections.unpooled() as listener:
                    listener.execute(f"LISTEN {_RELEASED_CHANNEL}")
                    listening = True
                    while True:
                        # Looked at again once listening, so that a release just before is not
                        # missed.
                        got = attempt()
                        left = deadline - time.monotonic()
                        if got.acquired or left <= 0:
                            return got
                        pause = min(left, RECHECK_INTERVAL)
                        if got.outcome == "held" and got.expires_in is not None:
                            pause = min(pause, max(got.expires_in, 0.05))
                        for notice in listener.notifies(timeout=pause):
                            if notice.payload == params["name"]:
                                break
            except self._driver_errors as exc:
                if not listening:  # no connection to listen on: the database is not answering
                    raise _wrap(exc) from exc
                # The server ended the listening session (terminated, an idle session
                # timeout): the wait goes on, on a new connection.
                log.info(
                    "lease %s: the wait's listening connection ended, listening again: %s",
                    params["name"],
                    exc,
                    extra={"lease": params["name"]},
                )

    def _busy(
        self, name: str, error: FenceDatabaseError, call: str, lock_timeout: float
    ) -> Acquisition:
        """The answer to a call that waited past ``lock_timeout`` for the lease's row; any other
        database error is raised again."""
        self._check_busy(name, error, call)
        owner = self._owner_within(name, lock_timeout)
        return Acquisition(outcome="busy", lease=None, owner=owner)

    def _owner_within(self, name: str, lock_timeout: float) -> Owner | None:
        """The owner a busy answer reports, read waiting no longer for the lease table than the
        call did (``lock_timeout``): ``None`` when the table itself stays locked that long (by a
        ``VACUUM FULL`` or a migration, say; fenced writers lock rows, which a read does not
        wait for)."""
        try:
            return self._read_owner(name, lock_timeout)
        except FenceDatabaseError as exc:
            if not _kept_waiting(exc):
                raise
            return None

    def _check_busy(self, name: str, error: FenceDatabaseError, call: str) -> None:
        """Log and count ``error`` if it ended a call that waited past ``lock_timeout`` for the
        lease's row; raise it again if it is any other database error."""
        if not _kept_waiting(error):
            raise error
        self.metrics.incr(f"{call}.busy")
        log.info(
            "lease %s busy: %s waited past lock_timeout for a lock on the lease",
            name,
            call,
            extra={"lease": name},
        )

    def renew(self, lease: Lease, *, ttl: float | None = None, enforce: bool = True) -> Lease:
        """Extend the lease (never its epoch, never past its maximum hold).

        Raises :class:`LeaseLostError` with the current owner when the lease was superseded,
        released, paused or expired; the database records that stale renewal (``enforce=False``:
        as shadow mode's, which would have been rejected). Raises :class:`FenceDatabaseError`
        when fenced writers kept the lease's row locked past ``lock_timeout``: the lease is
        unchanged, and the renewal may be tried again.
        """
        lease = _a_lease(lease, "renew")
        ttl_seconds = self._ttl(lease.ttl if ttl is None else ttl)
        started = time.monotonic()
        params = {**self._holder_params(lease, enforce=enforce), "ttl": ttl_seconds}
        row = self._call_as_holder("renew", "renewed", lease, params)
        if row["outcome"] != "renewed":
            raise self._rejected(params, row, "renew")
        self.metrics.incr("renew.renewed")
        return replace(
            self._lease(row, started, ttl_seconds), sharer=lease.sharer, joined_at=lease.joined_at
        )

    def release(self, lease: Lease, *, enforce: bool = True, finished: bool = True) -> Released:
        """Give the lease up at once (idempotent): ``"released"``. Only its holder can: a stale
        release raises :class:`LeaseLostError` and is recorded (``enforce=False``: as shadow
        mode's). A sharer of a lease shared with continuations (see :meth:`rejoin`) only leaves
        it, ``"left"``, while others hold it; a continuation's delivery (``lease.sharer``) leaves
        as finished, so that a redelivery of its message is dropped, or, with
        ``finished=False`` (its message put back), keeping its share for the redelivery, which
        joins in its place; such a delivery leaves once, however often it releases. A sharer
        without a delivery counts each release as one sharer leaving.
        Raises :class:`FenceDatabaseError` when fenced writers kept the lease's row locked past
        ``lock_timeout``: the lease is unchanged (it runs out at its expiry), and the release
        may be tried again."""
        lease = _a_lease(lease, "release")
        params = {
            **self._holder_params(lease, enforce=enforce),
            "sharer": lease.sharer,
            "finished": validation.check_flag(finished, "finished"),
            "joined_at": lease.joined_at,
        }
        row = self._call_as_holder("release", "released", lease, params)
        outcome: Released = row["outcome"]
        if outcome not in get_args(Released):
            raise self._rejected(params, row, "release")
        self.metrics.incr(f"release.{outcome}")
        who = (lease.name, lease.holder, lease.epoch)
        extra = {"lease": lease.name, "epoch": lease.epoch, "holder": lease.holder}
        if outcome == "released":
            log.info("lease %s released by %s at epoch %d", *who, extra=extra)
        else:
            log.info(
                "lease %s left by %s at epoch %d; its other sharers hold it", *who, extra=extra
            )
        return outcome

    def _holder_params(self, lease: Lease, *, enforce: bool) -> dict[str, Any]:
        """What a renewal or release of ``lease`` sends: its identity, whether a stale one is
        recorded as enforced, the lock timeout, and the environment a stale run is recorded under
        if the lease's row does not exist (the row's own wins otherwise)."""
        return {
            "name": lease.name,
            "epoch": lease.epoch,
            "token": lease.token,
            "holder": lease.holder,
            "enforced": validation.check_flag(enforce, "enforce"),
            "now": self._now(),
            "lock_timeout": self.lock_timeout,
            "environment": self._fallback_environment(lease),
        }

    def _call_as_holder(
        self, call: str, done: str, lease: Lease, params: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Run ``call`` (renew or release) for ``lease``'s holder, as :meth:`_call_bounded`."""
        return self._call_bounded(
            call, f"lease {lease.name} epoch {lease.epoch} not {done}", params
        )

    def _call_bounded(self, call: str, not_done: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """Run ``call``, which locks the row of lease ``params["name"]`` to change it. One that
        waited past ``lock_timeout`` behind fenced writers is logged and counted
        (``<call>.busy``) and raised as a :class:`FenceDatabaseError` that says ``not_done`` and
        that the lease is unchanged."""
        try:
            return self._call(call, params)
        except FenceDatabaseError as exc:
            self._check_busy(params["name"], exc, call)
            raise FenceDatabaseError(
                f"{not_done}: the lease stayed locked past lock_timeout "
                f"({self.lock_timeout:g}s); it is unchanged"
            ) from exc.__cause__

    def rejoin(
        self,
        name: str,
        *,
        epoch: int,
        holder: str,
        mode: Mode,
        proof: str,
        ttl: float,
        action: str,
        enforce: bool = True,
        environment: str | None = None,
        successor: str | None = None,
        delivery_prefix: str | None = None,
    ) -> Acquisition:
        """Take up a lease at the epoch a continuation was published under (see
        ``celery_fence.rejoin`` in the SQL reference): in mode ``resume``, ``outcome`` is
        ``"joined"`` when the lease is shared with a run still holding it (one more sharer),
        ``"resumed"`` when this call took it over at the next epoch, with a new token and a new
        hold window, after a release or expiry with no newer epoch; either way the caller
        releases it when done. Mode ``join`` (a fenced beat's dispatch) only checks that the
        lease is held at ``epoch``: ``"joined"``, with no lease (the caller neither holds nor
        releases it) and the current ``owner``.

        ``outcome`` is ``"busy"`` (no lease) when the call waited longer than ``lock_timeout``:
        a resume for the lease's row (fenced writers held it), a join for the record of the
        stale run it found. Nothing was decided, and the same call may be made again later.

        A take-over is held by ``successor`` (default ``holder``). A resume that finds a newer
        epoch held by a holder starting with ``delivery_prefix`` (an earlier delivery of the
        continuation's own message) is not stale: ``outcome`` is ``"held"`` (``"paused"``, no
        lease) while that holder holds the lease; the lease is taken over once it expired, and the
        resume is stale once that holder released it.

        A resume that joins with ``delivery_prefix`` is kept as that delivery's join of the epoch
        (the lease's ``sharer``, which its release leaves). A later resume with the same prefix
        at that epoch, a redelivery of the same message, is not joined again: ``outcome`` is
        ``"shared"`` (no lease) while the earlier delivery has not left and the lease is held,
        ``"done"`` (no lease, nothing recorded) once it left finished, its work done, also when
        a newer epoch exists; an earlier delivery that never left (its worker lost) keeps the
        lease shared until it expires, when the resume takes it over as above, and one that left
        unfinished (``release(finished=False)``) is replaced by the resume's join.

        Raises :class:`LeaseLostError` when a newer epoch exists, the lease is paused, or the
        proof does not match; the database records the stale run, under the lease's
        environment, or ``environment`` for a lease that does not exist (``missing``)."""
        try:
            proof_bytes = bytes.fromhex(proof)
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"proof must be hex, got {proof!r}") from exc
        ttl_seconds = self._ttl(ttl)
        name = validation.check_name(name)
        prefix = (
            validation.check_text(
                "" if delivery_prefix is None else delivery_prefix,
                "delivery_prefix",
                max_length=validation.MAX_NAME_LENGTH,
                allow_empty=True,
            )
            or None
        )
        params = {
            "name": name,
            "epoch": validation.check_epoch(epoch),
            "holder": validation.check_holder(holder),
            "mode": validation.check_choice(mode, "mode", get_args(Mode)),
            "proof": proof_bytes,
            "ttl": ttl_seconds,
            "action": self._action(action),
            "enforced": validation.check_flag(enforce, "enforce"),
            "now": self._now(),
            "lock_timeout": self.lock_timeout,
            "environment": self._optional_environment(environment),
            "successor": None if successor is None else validation.check_holder(successor),
            "delivery_prefix": prefix,
        }
        started = time.monotonic()
        try:
            row = self._call("rejoin", params)
        except FenceDatabaseError as exc:
            return self._busy(name, exc, "rejoin", self.lock_timeout)
        if row["outcome"] in ("held", "paused", "shared", "done"):
            return Acquisition(
                outcome=row["outcome"],
                lease=None,
                owner=_owner(row),
                expires_in=None if row["name"] is None else float(row["remaining"]),
            )
        if row["outcome"] not in ("joined", "resumed"):
            raise self._rejected(params, row, action)
        if mode == "join":
            # A check: the lease stays its holder's alone.
            return Acquisition(outcome=row["outcome"], lease=None, owner=_owner(row))
        lease = self._lease(row, started, ttl_seconds)
        if row["outcome"] == "joined" and prefix is not None:
            # A join the database keeps (see "shared" above): left as that delivery, which
            # joined as the lease was renewed.
            lease = replace(lease, sharer=prefix, joined_at=row["renewed_at"])
        if row["outcome"] == "resumed":
            log.info(
                "lease %s taken over by %s at epoch %d, continuing epoch %d",
                name,
                lease.holder,
                lease.epoch,
                epoch,
                extra={"lease": name, "epoch": lease.epoch, "holder": lease.holder},
            )
        return Acquisition(outcome=row["outcome"], lease=lease, owner=_owner(row))

    @contextmanager
    def guard(
        self, lease: Lease, conn: Executor, *, action: str, enforce: bool = True
    ) -> Iterator[Lease]:
        """Fence the writes made on ``conn`` inside the block.

        Before the block, a lease past its monotonic deadline is rejected without touching the
        database. After the block, in the same transaction, the lease row is locked ``FOR
        SHARE`` and checked: the writes can then commit only while the epoch still holds, and no
        acquisition can replace the lease until they have. A stale epoch raises
        :class:`StaleEpochError`, which rolls the caller's transaction back; the stale run is
        recorded on the store's own connection, so the record survives that rollback. The
        commit comes after the block: one inside it (of ``conn``'s transaction) is refused with
        :class:`ConfigurationError`, as is SQL sent through SQLAlchemy that would end or split
        the transaction (``COMMIT``, ``SAVEPOINT``, ...) and a block that leaves a savepoint
        open or had its transaction ended underneath SQLAlchemy. A transaction the server ends
        for idling past the lease's expiry (the check's idle limit) fails at its commit with
        :class:`StaleEpochError`, recorded.

        With ``enforce=False`` (shadow mode) the check and the record happen, but nothing is
        blocked, and a stale write is recorded once (the database's reason, else ``expired``
        for a lease past its deadline); the check runs in a savepoint, so that one failing under
        REPEATABLE READ or SERIALIZABLE leaves the caller's transaction to commit.
        """
        action = self._action(action)
        _a_lease(lease, "guard")
        validation.check_flag(enforce, "enforce")
        guarded = _guarded(conn)
        connection = _connection(guarded)
        # The check runs on the DB-API connection under ``conn``, inside its transaction.
        if _cursor(connection).connection.autocommit:
            raise ConfigurationError(
                "guard needs a connection in a transaction, not in autocommit: each write would "
                "commit before the fence check"
            )
        trusted = lease.trusted
        if not trusted and enforce:
            raise self._stale(
                lease,
                "expired",
                action,
                f"lease {lease.name} epoch {lease.epoch} passed its deadline before {action!r}",
            )
        _watch_block(guarded, connection)
        outer = _GUARDED.get(guarded, 0)  # guard blocks around this one
        block = _Block(guarded)
        blocks = _BLOCKS.setdefault(connection, [])
        if isinstance(guarded, Session):
            # The Session's outermost block decides which list its blocks follow it with.
            if outer:
                blocks = _SESSION_BLOCKS.get(guarded, blocks)
            else:
                _SESSION_BLOCKS[guarded] = blocks
        try:
            _GUARDED[guarded] = outer + 1
            blocks.append(block)
            yield lease
        finally:
            blocks.remove(block)
            if not outer and isinstance(guarded, Session):
                # Its next transaction, on another connection, gets blocks of its own.
                _SESSION_BLOCKS.pop(guarded, None)
            if outer:
                _GUARDED[guarded] = outer
            else:
                _GUARDED.pop(guarded, None)
        connection = _checked_connection(block, guarded, action)
        cursor = _cursor(connection)
        try:
            lease_limit = self._check_fence(
                lease, connection, cursor, action, enforce=enforce, trusted=trusted
            )
        except BaseException:
            if cursor.connection.broken:
                # Lost during the check, which SQLAlchemy did not see: without this, its
                # rollback of the caller's transaction would fail in place of the error.
                connection.invalidate()
            raise
        if lease_limit:
            # The check left the lease's time left as the idle limit: if the server ends the
            # session for it, the commit fails with this write's rejection.
            _listen_once(
                connection.engine,
                _ENDS_WATCHED_ENGINES,
                ("begin", _forget_checks),
                ("rollback", _forget_checks),
                ("rollback_savepoint", _forget_checks),
                ("handle_error", _ended_idle),
            )
            _CHECKED.setdefault(connection, []).append((self, lease, action))

    def _check_fence(
        self,
        lease: Lease,
        connection: sa.Connection,
        cursor: Any,
        action: str,
        *,
        enforce: bool,
        trusted: bool,
    ) -> bool:
        """The check at the end of a guard block, on ``cursor`` in the caller's transaction on
        ``connection``. Whether it left the lease's time left as the transaction's idle limit
        (enforced, on the database clock, and shorter than the limit already in force)."""
        params = {
            "name": lease.name,
            "epoch": lease.epoch,
            "token": lease.token,
            "now": self._now(),
        }
        if not enforce:
            # One record for one write: the database's reason when it finds the lease stale
            # (superseded rather than expired, say), else the holder's own deadline's.
            reason = self._shadow_check(cursor, params) or (None if trusted else "expired")
            if reason is not None:
                self._record_rejection(lease, reason, action, enforced=False)
            return False
        try:
            (answer,) = self._run(cursor, "fence", params)
        except self._driver_errors as exc:
            if _sqlstate(exc) == _IDLE_IN_TRANSACTION_TIMEOUT:
                # Ended idling past an earlier check's lease, or this one's.
                checked = [*_CHECKED.pop(connection, []), (self, lease, action)]
                rejection = _idle_rejection(checked)
                if rejection is not None:
                    raise rejection from exc
            reason = self._fence_failure(exc, params)
            if reason is None:
                state = _sqlstate(exc)
                # A lease the transaction finds missing (_STALE_EPOCH) while the store finds it
                # held is one in another database, when the connections name two.
                elsewhere = self._elsewhere(cursor) if state == _STALE_EPOCH else ""
                if elsewhere and _read_committed(cursor.connection):
                    raise FenceDatabaseError(
                        f"fenced write {action!r}: lease {lease.name} is held, but not in the "
                        f"database of the guarded transaction{elsewhere}"
                    ) from exc
                if state in (_SERIALIZATION_FAILURE, _STALE_EPOCH):
                    raise FenceDatabaseError(
                        f"fenced write {action!r}: lease {lease.name} was acquired or renewed "
                        "after this transaction's snapshot (REPEATABLE READ or SERIALIZABLE); it "
                        f"is still held: retry the transaction{elsewhere}"
                    ) from exc
                error = _wrap(exc)
                if isinstance(error, SchemaNotInstalledError):
                    error = SchemaNotInstalledError(f"{error}{self._elsewhere(cursor)}")
                raise error from exc
            raise self._stale(
                lease,
                reason,
                action,
                f"fenced write {action!r} rejected: lease {lease.name} "
                f"epoch {lease.epoch} is {reason}",
            ) from exc
        self.metrics.incr("guard.passed")
        return bool(answer["lease_limit"])

    def _stale(self, lease: Lease, reason: str, action: str, message: str) -> StaleEpochError:
        """The error rejecting a fenced write of ``lease`` as stale, once the rejection is
        recorded. The write is rejected whatever happens to the record: a database error on the
        way is logged rather than raised in the rejection's place."""
        self._record_rejection(lease, reason, action, enforced=True)
        try:
            owner = self.owner(lease.name)
        except FenceDatabaseError:
            owner = None
        return StaleEpochError(
            message, lease_name=lease.name, epoch=lease.epoch, owner=owner, reason=reason
        )

    def _rejected_after_idling(self, lease: Lease, action: str) -> StaleEpochError | None:
        """The rejection, once recorded, of a write fenced by ``lease`` whose session the server
        ended for idling in its transaction, if the lease is stale by now (judged on the store's
        own connection); ``None`` while it still holds or when it cannot be judged."""
        params = {"name": lease.name, "epoch": lease.epoch, "token": lease.token, "now": None}
        try:
            reason = self._judged_afresh(params)
        except FenceDatabaseError as exc:
            log.warning(
                "lease %s epoch %s could not be judged after the server ended an idle fenced "
                "transaction: %s",
                lease.name,
                lease.epoch,
                exc,
                extra={"lease": lease.name, "epoch": lease.epoch},
            )
            return None
        if reason is None:
            return None
        return self._stale(
            lease,
            reason,
            action,
            f"fenced write {action!r} rejected: the server ended its transaction, left idle "
            f"after the check past the expiry of lease {lease.name} epoch {lease.epoch}, "
            f"which is {reason}",
        )

    def _elsewhere(self, cursor: Any) -> str:
        """For a fence check that found no lease or no schema: the database names the guard's
        connection and the store's were given, when they differ (the check may then have run in
        another database than the leases'; a pooler's alias may also name the same one)."""
        theirs = cursor.connection.info.dbname
        ours = self.engine.url.database
        if not ours or theirs == ours:
            return ""
        return (
            f" (the guard's connection names database {theirs!r}, the store's {ours!r}: fenced "
            "writes must run in the database that holds the leases)"
        )

    def _shadow_check(self, cursor: Any, params: Mapping[str, Any]) -> str | None:
        """Why a shadow-mode write's lease is stale, or ``None`` while it holds. The check runs
        in a savepoint of the caller's transaction: a check that cannot lock the lease row under
        REPEATABLE READ or SERIALIZABLE is rolled back to the savepoint, so that the transaction
        goes on and commits, as shadow mode promises. Any other database error (a timeout, a
        lost connection) is raised, as it would be for the caller's own statements."""
        try:
            cursor.execute(f"SAVEPOINT {_SHADOW_SAVEPOINT}")
            try:
                (row,) = self._run(cursor, "check_fence", params)
                reason: str | None = row["reason"]
                if reason == _MISSING:
                    reason = self._judged_afresh(params)
            except self._driver_errors as exc:
                # Under REPEATABLE READ or SERIALIZABLE, a lease row changed after the snapshot
                # cannot be locked: the row stays unlocked, and the lease is judged afresh.
                if _sqlstate(exc) != _SERIALIZATION_FAILURE:
                    raise
                cursor.execute(f"ROLLBACK TO SAVEPOINT {_SHADOW_SAVEPOINT}")
                reason = self._fence_failure(exc, params)
            cursor.execute(f"RELEASE SAVEPOINT {_SHADOW_SAVEPOINT}")
        except self._driver_errors as exc:
            raise _wrap(exc) from exc
        return reason

    def _fence_failure(self, exc: BaseException, params: Mapping[str, Any]) -> str | None:
        """Why a fence check failed because its lease is stale, or ``None`` when it failed for
        anything else, or found the lease still held when judged afresh."""
        state = _sqlstate(exc)
        if state == _STALE_EPOCH:
            reason = str(exc).split("stale epoch (", 1)[-1].split(")", 1)[0]
            return self._judged_afresh(params) if reason == _MISSING else reason
        if state == _SERIALIZATION_FAILURE:
            # Under REPEATABLE READ or SERIALIZABLE, locking a lease row changed since the
            # transaction's snapshot fails before any judgement.
            return self._judged_afresh(params)
        return None

    def _judged_afresh(self, params: Mapping[str, Any]) -> str | None:
        """Why the lease of a fence check is stale, judged on the store's own connection, or
        ``None`` while it holds: for a check whose snapshot (REPEATABLE READ or SERIALIZABLE)
        cannot tell, because the lease row changed after it, or was created after it. It locks
        nothing (see the ``judge`` query): the caller's transaction may hold the lease's
        writers' key."""
        (row,) = self._rows("judge", params)
        reason: str | None = row["reason"]
        return reason

    def record_stale_run(
        self,
        name: str,
        *,
        epoch: int | None,
        holder: str,
        reason: str,
        action: str,
        environment: str | None = None,
        enforced: bool = True,
    ) -> StaleRun:
        """Store a stale run the protocol functions could not record themselves (a forged or
        malformed header, a write rejected by its holder's own deadline), log and count it. A
        lock on the stale-run table (maintenance's) keeps it waiting no longer than
        ``lock_timeout``: then :class:`FenceDatabaseError`, and nothing is recorded."""
        (row,) = self._rows(
            "record_stale_run",
            {
                "name": validation.check_name(name),
                "epoch": None if epoch is None else validation.check_epoch(epoch),
                "holder": validation.check_holder(holder),
                "reason": validation.check_choice(reason, "reason", _STALE_REASONS),
                "action": self._action(action),
                "environment": self._environment(environment),
                "enforced": validation.check_flag(enforced, "enforced"),
                "now": self._now(),
            },
            lock_timeout=self.lock_timeout,
        )
        record = StaleRun(**row)
        self._report(
            lease_name=record.lease_name,
            environment=record.environment,
            stale_epoch=record.stale_epoch,
            stale_holder=record.stale_holder,
            current_epoch=record.current_epoch,
            current_holder=record.current_holder,
            reason=record.reason,
            action=record.action,
            enforced=record.enforced,
        )
        return record

    def claim_slot(self, lease: Lease, *, entry: str, slot: datetime, task: str) -> bool:
        """Claim one schedule slot for dispatch under ``lease``, in a fenced transaction.

        True the first time a slot of ``entry`` is claimed for the lease's schedule, false ever
        after, whoever asks; :class:`StaleEpochError` when ``lease`` no longer holds. The fence
        check comes first, so that the claim's row lock and idle limit are in place before the
        slot is written, and a claim kept waiting by another's uncommitted claim of the slot (a
        paused former leader's) waits no longer than ``lock_timeout`` or the lease's time left:
        then :class:`FenceDatabaseError`, and nothing is claimed.
        """
        _a_lease(lease, "claim_slot")
        validation.check_aware(slot, "slot")
        params = {
            "schedule": lease.name,
            "entry": validation.check_entry(entry),
            "slot": slot,
            "task": validation.check_text(task, "task", max_length=validation.MAX_TEXT_LENGTH),
            "epoch": lease.epoch,
            "holder": lease.holder,
            "now": self._now(),
        }
        try:
            with self.engine.begin() as conn:
                with self.guard(lease, conn, action=f"dispatch {entry} for {slot.isoformat()}"):
                    pass
                # Through the connection, not its cursor: a session the server ends for idling
                # past the lease's expiry from here on fails with the claim's rejection (see
                # guard), as its commit would.
                wait = max(min(self.lock_timeout, lease.remaining()), 0.001)
                self._execute(conn, "bound_lock_wait", {"lock_timeout": wait})
                claimed = self._execute(conn, "claim_slot", params).first() is not None
        except self._driver_errors as exc:
            raise _wrap(exc) from exc
        return claimed

    def dispatches(
        self, schedule: str, *, entry: str | None = None, limit: int = 100
    ) -> list[Dispatch]:
        """Slots dispatched for ``schedule`` (the scheduler's lease name), newest first; only
        those of ``entry`` when given."""
        params = {"schedule": validation.check_name(schedule), "limit": self._limit(limit)}
        if entry is None:
            rows = self._read("dispatches", params)
        else:
            params["entry"] = validation.check_entry(entry)
            rows = self._read("entry_dispatches", params)
        return [Dispatch(**row) for row in rows]

    def latest_dispatches(self, schedule: str, entries: Iterable[str]) -> dict[str, Dispatch]:
        """The latest slot claimed for each of ``entries`` (each checked as for
        :meth:`claim_slot`) of ``schedule``, read at once: by entry, for the entries with one."""
        if isinstance(entries, str):
            raise ConfigurationError("entries must be a collection of entry names, not a string")
        params = {
            "schedule": validation.check_name(schedule),
            "entries": list(dict.fromkeys(validation.check_entry(entry) for entry in entries)),
        }
        if not params["entries"]:
            return {}
        return {row["entry"]: Dispatch(**row) for row in self._read("latest_dispatches", params)}

    # -- the kill switch --------------------------------------------------------------------

    def pause(
        self, name: str, *, reason: str, by: str = "celery-fence", environment: str | None = None
    ) -> Owner:
        """Stop the lease from being acquired or renewed until :meth:`resume`; its holder's
        fenced writes are rejected from now on. The pause waits for the fenced transactions
        already open on the lease, and raises :class:`FenceDatabaseError` (the lease unchanged)
        when they keep it waiting past ``lock_timeout``."""
        row = self._call_bounded(
            "pause",
            f"lease {name} not paused",
            {
                "name": validation.check_name(name),
                "reason": validation.check_text(
                    reason, "reason", max_length=validation.MAX_TEXT_LENGTH
                ),
                "by": validation.check_holder(by, "by (who pauses)"),
                "environment": self._environment(environment),
                "now": self._now(),
                "lock_timeout": self.lock_timeout,
            },
        )
        log.warning("lease %s paused by %s: %s", name, by, reason, extra={"lease": name})
        owner = _owner(row)
        assert owner is not None
        return owner

    def resume(self, name: str) -> Owner:
        """Lift a pause. Raises :class:`LeaseError` for a lease that does not exist, and
        :class:`FenceDatabaseError` (the lease unchanged) when fenced transactions already open
        on the lease keep it waiting past ``lock_timeout``."""
        row = self._call_bounded(
            "resume",
            f"lease {name} not resumed",
            {
                "name": validation.check_name(name),
                "now": self._now(),
                "lock_timeout": self.lock_timeout,
            },
        )
        owner = _owner(row)
        if owner is None:
            raise LeaseError(f"no lease named {name}", lease_name=name)
        log.warning("lease %s resumed", name, extra={"lease": name})
        return owner

    # -- reading ----------------------------------------------------------------------------

    def owner(self, name: str) -> Owner | None:
        """The lease's current safe metadata, or ``None`` if it was never taken or paused."""
        return self._read_owner(validation.check_name(name), self.lock_timeout)

    def _read_owner(self, name: str, lock_timeout: float) -> Owner | None:
        """:meth:`owner`, its wait for the lease table bounded by ``lock_timeout``."""
        return _owner_of(
            self._rows("owner", {"name": name, "now": self._now()}, lock_timeout=lock_timeout)
        )

    def leases(self, environment: str | None = None) -> list[Owner]:
        rows = self._read(
            "leases", {"environment": self._optional_environment(environment), "now": self._now()}
        )
        return [owner for row in rows if (owner := _owner(row)) is not None]

    def stale_runs(
        self, *, environment: str | None = None, lease_name: str | None = None, limit: int = 100
    ) -> list[StaleRun]:
        """Rejected stale runs, newest first."""
        rows = self._read(
            "stale_runs",
            {
                "environment": self._optional_environment(environment),
                "lease_name": None if lease_name is None else validation.check_name(lease_name),
                "limit": self._limit(limit),
            },
        )
        return [StaleRun(**row) for row in rows]

    def history(self, name: str, *, limit: int = 100) -> list[HistoryEntry]:
        """Who won each epoch of the lease, newest first."""
        rows = self._read(
            "history",
            {"name": validation.check_name(name), "limit": self._limit(limit), "now": self._now()},
        )
        return [HistoryEntry(**row) for row in rows]

    def released_by(self, name: str, *, since_epoch: int, holder_prefix: str) -> bool:
        """Whether an epoch of the lease from ``since_epoch`` on ended released by a holder whose
        name starts with ``holder_prefix`` (a run of one message, whatever its host)."""
        (row,) = self._read(
            "released_by",
            {
                "name": validation.check_name(name),
                "epoch": validation.check_epoch(since_epoch),
                "prefix": validation.check_holder(holder_prefix),
            },
        )
        return bool(row["released"])

    # -- internals --------------------------------------------------------------------------

    def _now(self) -> datetime | None:
        if self.clock is None:
            return None
        return validation.check_aware(self.clock(), "the store's clock reading")

    def _environment(self, environment: str | None) -> str:
        return validation.check_environment(
            self.default_environment if environment is None else environment
        )

    @staticmethod
    def _optional_environment(environment: str | None) -> str | None:
        return None if environment is None else validation.check_environment(environment)

    def _ttl(self, ttl: float) -> float:
        return validation.check_seconds(ttl, "ttl", maximum=self.max_ttl)

    def _max_hold(self, max_hold: float | None, ttl: float) -> float | None:
        if max_hold is None:
            return None
        return validation.check_max_hold(max_hold, ttl)

    @staticmethod
    def _action(action: str) -> str:
        return validation.check_text(action, "action", max_length=validation.MAX_TEXT_LENGTH)

    @staticmethod
    def _limit(limit: int) -> int:
        if (
            isinstance(limit, bool)
            or not isinstance(limit, int)
            or not 1 <= limit <= validation.MAX_LIMIT
        ):
            raise ConfigurationError(
                f"limit must be an integer from 1 to {validation.MAX_LIMIT}, got {limit!r}"
            )
        return limit

    def _lease(self, row: Mapping[str, Any], started: float, ttl: float) -> Lease:
        trusted_for = max(0.0, float(row["remaining"])) * (1.0 - self.safety_margin)
        return Lease(
            name=row["name"],
            environment=row["environment"],
            holder=row["holder"],
            purpose=row["purpose"],
            epoch=row["epoch"],
            token=row["token"],
            acquired_at=row["acquired_at"],
            expires_at=row["expires_at"],
            hold_until=row["hold_until"],
            ttl=ttl,
            deadline=started + trusted_for,
        )

    def _rows(
        self, query: str, params: Mapping[str, Any], *, lock_timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """Run a named query in autocommit on one of the store's own connections; wrap driver
        errors. With ``lock_timeout`` (seconds), the query runs in a transaction of its own whose
        lock waits are bounded by it. The store's first query checks the schema's version."""
        if not self._schema_checked and query != "schema_version":
            self.check_schema()
        try:
            # What _Connections.connection() does, without a generator on every call.
            cursor, generation = self._connections.checkout()
            try:
                if lock_timeout is None:
                    return self._run(cursor, query, params)
                with cursor.connection.transaction():
                    cursor.execute(
                        "SELECT pg_catalog.set_config('lock_timeout', %s, true)",
                        (_sql.milliseconds(lock_timeout),),
                    )
                    return self._run(cursor, query, params)
            finally:
                self._connections.checkin(cursor, generation)
        except self._driver_errors as exc:
            raise _wrap(exc) from exc

    def _read(self, query: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """A read's rows (:meth:`_rows`), its wait for a table that maintenance holds (``VACUUM
        FULL``, a migration) bounded by ``lock_timeout``: past it, :class:`FenceDatabaseError`.
        In a transaction of its own, so that the bound is not left on a session that a
        transaction-pooling PgBouncer hands to others."""
        return self._rows(query, params, lock_timeout=self.lock_timeout)

    def _execute(
        self, conn: sa.Connection, query: str, params: Mapping[str, Any]
    ) -> sa.CursorResult[Any]:
        """Execute a named statement on a SQLAlchemy connection, whose events see it."""
        statement = self._statements[query]
        return conn.exec_driver_sql(statement.sql, statement.parameters(params))

    def _run(self, cursor: Any, query: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Execute a named statement on a DB-API cursor; its rows as dicts."""
        statement = self._statements[query]
        cursor.execute(statement.sql, statement.parameters(params))
        # The column names straight from the result: psycopg's ``description`` builds a Column
        # object per column, which costs more than the rest of a protocol call here.
        result = cursor.pgresult
        if result is None or not result.nfields:
            return []
        names = [result.fname(i).decode() for i in range(result.nfields)]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def _call(self, query: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """Like :meth:`_rows` for a query that answers exactly one row."""
        rows = self._rows(query, params)
        if len(rows) != 1:
            raise FenceDatabaseError(f"{query} answered {len(rows)} rows, expected one")
        return rows[0]

    def _rejected(
        self, params: Mapping[str, Any], row: Mapping[str, Any], action: str
    ) -> LeaseLostError:
        """Log and count a rejection the database already recorded for the call made with
        ``params``; build its error."""
        name, epoch, reason = params["name"], params["epoch"], row["reason"]
        owner = _owner(row)
        environment = self._recorded_environment(params, action, owner)
        self._report(
            lease_name=name,
            environment=environment,
            stale_epoch=epoch,
            stale_holder=params["holder"],
            current_epoch=owner.epoch if owner else None,
            current_holder=owner.holder if owner else None,
            reason=reason,
            action=action,
            enforced=params["enforced"],
        )
        return LeaseLostError(
            f"{action} rejected: lease {name} epoch {epoch} is {reason}"
            + (f" (current epoch {owner.epoch}, holder {owner.holder})" if owner else ""),
            lease_name=name,
            epoch=epoch,
            owner=owner,
            reason=reason,
        )

    def _recorded_environment(
        self, params: Mapping[str, Any], action: str, owner: Owner | None
    ) -> str:
        """The environment the database recorded the stale call made with ``params`` under (see
        ``celery_fence.record_stale_run``), read back; when it cannot be read (nothing was
        recorded, the read failed), the one the call passed (its epoch's, for a renewal or
        release), else the lease's."""
        try:
            rows = self._read(
                "stale_run_environment",
                {
                    "name": params["name"],
                    "epoch": params["epoch"],
                    "holder": params["holder"],
                    "action": action,
                },
            )
        except FenceError:
            rows = []
        if rows:
            return str(rows[0]["environment"])
        return params["environment"] or (owner.environment if owner is not None else "")

    @staticmethod
    def _fallback_environment(lease: Lease) -> str | None:
        """The lease's environment for the database to record a stale run under when the lease
        row has none to give. One written by a SQL client that this library would refuse is
        left out (``None``) rather than stop the call."""
        return validation.readable(validation.check_environment, lease.environment)

    def _record_rejection(self, lease: Lease, reason: str, action: str, *, enforced: bool) -> None:
        """Record a fenced write's rejection. When the database cannot take the record, the
        rejection is logged and counted all the same, and the failure logged: the write is
        rejected (or, in shadow mode, let through) either way."""
        environment = self._fallback_environment(lease)
        try:
            # The database records the environment of the lease's epoch, the lease's own.
            self.record_stale_run(
                lease.name,
                epoch=lease.epoch,
                holder=lease.holder,
                reason=reason,
                action=action,
                environment=environment,
                enforced=enforced,
            )
        except FenceError as exc:
            self._report(
                lease_name=lease.name,
                environment=environment or "",
                stale_epoch=lease.epoch,
                stale_holder=lease.holder,
                current_epoch=None,
                current_holder=None,
                reason=reason,
                action=action,
                enforced=enforced,
            )
            stale_log.error(
                "stale %s of lease %s epoch %s not recorded: %s",
                action,
                lease.name,
                lease.epoch,
                exc,
                extra={"lease": lease.name, "epoch": lease.epoch},
            )

    def _report(self, **fields: Any) -> None:
        """Log and count one rejection; ``fields`` are a stale-run record's columns."""
        self.metrics.incr(f"rejected.{fields['reason']}")
        verdict = "rejected" if fields["enforced"] else "would be rejected (shadow mode)"
        if fields["reason"] == "malformed":
            # A header that could not be read has no epoch to tell; record_stale_run, the only
            # call that reports one, has recorded it by now.
            stale_log.warning(
                "stale %s %s: malformed celery_fence header for lease %s from holder %s, "
                "recorded as a stale run",
                fields["action"],
                verdict,
                fields["lease_name"],
                fields["stale_holder"],
                extra=fields,
            )
            return
        stale_log.warning(
            "stale %s %s: lease %s epoch %s held by %s is %s (current epoch %s, holder %s)",
            fields["action"],
            verdict,
            fields["lease_name"],
            fields["stale_epoch"],
            fields["stale_holder"],
            fields["reason"],
            fields["current_epoch"],
            fields["current_holder"],
            extra=fields,
        )
