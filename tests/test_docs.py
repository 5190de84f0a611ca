"""The docs cannot rot: every example and command in ``docs/`` is run here or where it runs.

The conventions a page follows (each is enforced below):

- A ```` ```python ```` block right after the comment ``<!-- run -->`` is executed. The runnable
  blocks of a page run in order, in one namespace, with the page's own fresh database in
  ``CELERY_FENCE_DATABASE_URL`` and a temporary working directory (also on ``sys.path``).
  Every other ```` ```python ```` block must at least compile.
- A ```` ```sql ```` block right after ``<!-- run -->`` runs through ``psql`` on that database.
- A block right after ``<!-- file: NAME -->`` is written to ``NAME`` in the working directory.
- In ```` ```console ```` (or ``shell``) blocks, ``$ command`` is a command; the lines after it, up
  to the next command, are its output, compared with what it prints (``...`` matches anything,
  whitespace is normalized). A trailing ``# exit N`` says the command exits with status N
  (default 0). Which commands run here:

  - every ``$ celery-fence ...`` line, through ``bash`` in the working directory, against the
    page's database;
  - every command of a block after ``<!-- run -->``; those of a block after
    ``<!-- run: background -->`` are started in the background and stopped when the page ends;
  - before a block after ``<!-- meanwhile: COMMAND -->``, ``COMMAND`` (a ``celery-fence``
    command), unseen: what processes the reader started on the page (a beat, a worker) have
    done by then, which this runner does not start;
  - ``$ export NAME=...`` of a variable this runner sets itself (:data:`PROVIDED`) is not run,
    nor is ``$ createdb ...``: the runner gives each page a fresh database of its own;
  - ``$ pip install ...`` must name this project and extras it has;
  - any other command must be run by a script or test of the repository: its words occur in
    one of :data:`RUNNER_GLOBS` in that order, or :data:`RUN_BY` says which file runs it.

- :data:`DELEGATED` pages have a dedicated test that runs their examples; the page runner and
  the command checks leave them to it.
- Relative links resolve (anchors included), and every page is reachable from ``index.md``.
- The reference names every ``fence_*`` setting, public name and SQL object.

Commands the page runner starts get the page's database for both the lease store and Celery's
broker and results (``sqla+``/``db+`` URLs), so that pages never share a queue.
"""

from __future__ import annotations

import ast
import codeop
import dataclasses
import doctest
import importlib
import inspect
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from importlib.metadata import metadata
from pathlib import Path
from types import FunctionType
from typing import Any

import kombu
import pytest
from celery import Celery
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session

import celery_fence
import celery_fence.contrib.celery as fence_celery
from celery_fence import LeaseStore, models
from celery_fence.contrib.celery import Fence, FencedRun, FenceSettings
from celery_fence.contrib.celery.beat import FencedScheduler
from celery_fence.contrib.celery.settings import DEFAULTS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SHELL_LANGUAGES = {"console", "shell", "sh", "bash", "shell-session"}
#: Variables the page runner sets: a page's ``$ export`` of one of them is not run.
PROVIDED = {"CELERY_FENCE_DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"}
#: Files that run commands: a documented command whose words occur in one of them is run there.
RUNNER_GLOBS = (
    "scripts/*",
    ".ci/*",
    "docker-compose.yml",
    "tests/**/*.py",
    "example_app/**/*.py",
    "benchmarks/**/*.py",
)
#: Commands run by code that builds them from parts: the start of the documented command, the
#: file that runs it and a fragment of that file that does.
RUN_BY: dict[str, tuple[str, str]] = {
    "celery -A proj beat -S fence": (
        "example_app/__main__.py",
        '"beat": ("beat", "-S", "fence", "--loglevel=INFO")',
    ),
    "celery -A proj worker": ("example_app/__main__.py", '"worker": ("worker", "--loglevel=INFO")'),
    "scripts/canary": ("tests/test_cli.py", 'REPO / "scripts" / "canary"'),
    ".venv/bin/python benchmarks/bench_protocol.py": (
        "tests/test_benchmarks.py",
        '"benchmarks/bench_protocol.py"',
    ),
    ".venv/bin/python benchmarks/bench_tasks.py": (
        "tests/test_benchmarks.py",
        '"benchmarks/bench_tasks.py"',
    ),
}
#: Pages whose examples a dedicated test runs, and the test.
DELEGATED = {"reference/cli.md": "tests/test_cli.py"}
KNOWN_MARKERS = re.compile(
    r"^(run|run: background|file: [\w./-]+|grants: (superuser|owner|reader)"
    r"|meanwhile: celery-fence .+)$"
)
COMMAND_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0
_END_OF_BLOCK = "-- end of block --"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<text>.*?)\s*-->\s*$")
_EXIT = re.compile(r"\s#\s*exit\s+(?P<code>\d+)\b[^'\"]*$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_WORDS = re.compile(r"[^\s\"'`,\[\]()]+")


# -- reading the docs ------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, the marker comment right before it, and its text."""

    page: Path
    line: int  # the line number of the block's first line of text
    language: str
    marker: str | None
    body: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(DOCS)}:{self.line}"


@dataclass(frozen=True)
class Command:
    """One ``$ command`` of a shell block, with the output and exit status the page shows."""

    block: Block
    line: int
    text: str
    output: str
    exit_code: int

    @property
    def where(self) -> str:
        return f"{self.block.page.relative_to(DOCS)}:{self.line}"

    @property
    def kind(self) -> str:
        """``run``, ``background``, ``provided``, ``install`` or ``elsewhere``."""
        export = re.match(r"export (\w+)=", self.text)
        if (export and export[1] in PROVIDED) or self.text.startswith("createdb "):
            return "provided"
        if self.block.marker == "run: background":
            return "background"
        if self.block.marker == "run" or self.text.startswith("celery-fence"):
            return "run"
        if re.match(r"(python -m )?pip install ", self.text):
            return "install"
        return "elsewhere"


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _closes(line: str, fence: str) -> bool:
    return re.fullmatch(rf"[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*", line) is not None


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found = []
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        indent, fence = len(match["indent"]), match["fence"]
        words = match["info"].split()
        end = index + 1
        while end < len(lines) and not _closes(lines[end], fence):
            end += 1
        body = [
            line[indent:] if line[:indent].isspace() else line for line in lines[index + 1 : end]
        ]
        previous = next((line for line in reversed(lines[:index]) if line.strip()), "")
        marker = _MARKER.match(previous)
        found.append(
            Block(
                page=page,
                line=index + 2,
                language=words[0] if words else "",
                marker=marker["text"] if marker else None,
                body="\n".join(body) + "\n",
            )
        )
        index = end + 1
    return found


def commands(block: Block) -> list[Command]:
    """The ``$ command`` lines of a shell block (``\\`` continues a command on the next line)."""
    found: list[Command] = []
    text: list[str] = []
    output: list[str] = []
    start = 0

    def flush() -> None:
        if text:
            command = "\n".join(text)
            match = _EXIT.search(command)
            found.append(
                Command(
                    block=block,
                    line=start,
                    text=command,
                    output="\n".join(output),
                    exit_code=int(match["code"]) if match else 0,
                )
            )

    for offset, line in enumerate(block.body.splitlines()):
        if text and text[-1].endswith("\\") and not output:
            text.append(line)
        elif line.startswith("$ "):
            flush()
            text, output, start = [line[2:]], [], block.line + offset
        elif text:
            output.append(line)
    flush()
    return found


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def delegated(page: Path) -> bool:
    return page.relative_to(DOCS).as_posix() in DELEGATED


def all_commands() -> list[Command]:
    return [
        command
        for block in all_blocks()
        if block.language in SHELL_LANGUAGES and not delegated(block.page)
        for command in commands(block)
    ]


def _runnable(page: Path) -> bool:
    if delegated(page):
        return False
    for block in blocks(page):
        if block.marker in ("run", "run: background") or (block.marker or "").startswith("file:"):
            return True
        if block.language in SHELL_LANGUAGES and any(
            command.kind in ("run", "background") for command in commands(block)
        ):
            return True
    return False


# -- running a page --------------------------------------------------------------------------


@dataclass
class PageRun:
    """Runs one page's examples and commands in order against the page's database."""

    page: Path
    workdir: Path
    env: dict[str, str]
    namespace: dict[str, Any] = dataclasses.field(default_factory=dict)
    background: list[tuple[Command, subprocess.Popen[bytes], Path]] = dataclasses.field(
        default_factory=list
    )
    psql: subprocess.Popen[str] | None = None

    def pipes(self) -> dict[str, Any]:
        """How the page's commands run: in its directory and environment, output and errors
        read together as text."""
        return {
            "cwd": self.workdir,
            "env": self.env,
            "stdout": subprocess.PIPE,
            "stderr": subprocess.STDOUT,
            "text": True,
        }

    def run(self) -> None:
        for block in blocks(self.page):
            marker = block.marker or ""
            if marker.startswith("meanwhile: "):
                text = marker.removeprefix("meanwhile: ")
                self.command(
                    Command(block=block, line=block.line, text=text, output="", exit_code=0)
                )
            if marker.startswith("file: "):
                (self.workdir / marker.removeprefix("file: ")).write_text(block.body)
            elif marker == "run" and block.language == "python":
                self.python(block)
            elif marker == "run" and block.language == "sql":
                self.sql(block)
            elif block.language in SHELL_LANGUAGES:
                for command in commands(block):
                    if command.kind == "run":
                        self.command(command)
                    elif command.kind == "background":
                        self.start(command)

    def python(self, block: Block) -> None:
        source = "\n" * (block.line - 1) + block.body
        self.namespace.setdefault("__name__", "__docs__")
        exec(compile(source, str(block.page), "exec"), self.namespace)

    def sql(self, block: Block) -> None:
        """Run the block in the page's ``psql`` session (started on first use), so that its
        variables carry over from one block to the next, as for a reader in one session."""
        if self.psql is None:
            psql = shutil.which("psql")
            if psql is None:
                pytest.fail(f"{block.where}: psql is needed to run this SQL block", pytrace=False)
            self.psql = subprocess.Popen(
                [
                    psql,
                    "-X",
                    "-q",
                    "-v",
                    "ON_ERROR_STOP=1",
                    "-d",
                    self.env["CELERY_FENCE_DATABASE_URL"],
                ],
                stdin=subprocess.PIPE,
                **self.pipes(),
            )
        assert self.psql.stdin is not None
        assert self.psql.stdout is not None
        self.psql.stdin.write(f"{block.body}\n\\echo {_END_OF_BLOCK}\n")
        self.psql.stdin.flush()
        output = []
        for line in self.psql.stdout:
            if line.rstrip("\n") == _END_OF_BLOCK:
                return
            output.append(line)
        pytest.fail(f"{block.where}: psql failed:\n{''.join(output)}", pytrace=False)

    def command(self, command: Command) -> None:
        result = subprocess.run(
            ["bash", "-c", command.text],
            stdin=subprocess.DEVNULL,
            timeout=COMMAND_TIMEOUT,
            check=False,
            **self.pipes(),
        )
        context = f"{command.where}: $ {command.text}\n{result.stdout}{self.logs()}"
        assert result.returncode == command.exit_code, (
            f"exit {result.returncode}, the page says {command.exit_code}: {context}"
        )
        if command.output.strip():
            checker = doctest.OutputChecker()
            flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
            want = command.output.strip() + "\n"
            assert checker.check_output(want, result.stdout.strip() + "\n", flags), (
                f"the output differs from the page's:\n{want}---\n{context}"
            )

    def start(self, command: Command) -> None:
        log = self.workdir / f"background-{len(self.background)}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                ["bash", "-c", f"exec {command.text}"],
                cwd=self.workdir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.background.append((command, process, log))

    def logs(self) -> str:
        return "".join(
            f"\n--- background `{command.text}` ({command.where}):\n"
            + log.read_text(errors="replace")[-4000:]
            for command, _, log in self.background
        )

    def close(self) -> None:
        """Stop the background processes (SIGTERM, then SIGKILL for their group) and release
        the connections the examples left open."""
        if self.psql is not None:
            self.psql.communicate(timeout=COMMAND_TIMEOUT)
        for _, process, _ in self.background:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                process.wait(STOP_TIMEOUT)
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for value in self.namespace.values():
            _close(value)


def _close(value: object) -> None:
    if isinstance(value, Engine):
        value.dispose()
    elif isinstance(value, LeaseStore):
        value.engine.dispose()
    elif isinstance(value, Fence):
        with suppress(celery_fence.FenceError):
            value.store.engine.dispose()
            value.keeper_store.engine.dispose()
    elif isinstance(value, (Celery, Session)):
        value.close()


@pytest.fixture
def page_env(database_url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment of a page's commands: its database for the leases, Celery's broker and
    its results; the virtualenv's programs first on ``PATH``."""
    url = make_url(database_url)
    plain = url.set(drivername="postgresql").render_as_string(hide_password=False)
    psycopg = url.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "CELERY_FENCE_ENVIRONMENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CELERY_FENCE_DATABASE_URL", plain)
    env = dict(os.environ)
    env.update(
        CELERY_FENCE_DATABASE_URL=plain,
        CELERY_BROKER_URL=f"sqla+{psycopg}",
        CELERY_RESULT_BACKEND=f"db+{psycopg}",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
    )
    # kombu's SQLAlchemy transport creates its tables when a process first uses it and does not
    # retry a concurrent creation: make them before a page's worker and client race to.
    with kombu.Connection(env["CELERY_BROKER_URL"]) as broker:
        broker.default_channel.session.close()
    return env


@pytest.fixture
def isolated_modules(tmp_path: Path) -> Iterator[None]:
    """Forget the modules a page imported from its working directory."""
    yield
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


RUNNABLE = [page for page in pages() if _runnable(page)]


@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(DOCS)) for p in RUNNABLE])
@pytest.mark.usefixtures("isolated_modules")
def test_page_runs_as_written(
    page: Path, page_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its runnable blocks and commands, in order, on a fresh database of its own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = PageRun(page=page, workdir=tmp_path, env=page_env)
    try:
        run.run()
    finally:
        run.close()


README = ROOT / "README.md"


def test_the_readme_example_publishes_under_its_epoch(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's task, on a database of its own with the table the README creates: each run
    writes the manifest, at its own epoch."""
    python, sql = (
        next(block.body for block in blocks(README) if block.language == language)
        for language in ("python", "sql")
    )
    monkeypatch.setenv("CELERY_FENCE_DATABASE_URL", database_url)
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    exec(compile(python, str(README), "exec"), namespace)
    try:
        engine = namespace["fence"].store.engine
        with engine.begin() as conn:
            conn.exec_driver_sql(sql)
        publish = namespace["publish"]
        assert publish.apply(args=("prod", "r-41", 41)).get() == 1
        assert publish.apply(args=("prod", "r-42", 42)).get() == 2
        with engine.connect() as conn:
            written = conn.exec_driver_sql("SELECT release_id, build, epoch FROM manifests").all()
        assert [tuple(row) for row in written] == [("r-42", 42, 2)]
    finally:
        for value in namespace.values():
            _close(value)


DEVELOPERS = ROOT / "DEVELOPERS.md"
#: A path of the repository as DEVELOPERS.md names one: `scripts/test`, `tests/conftest.py`.
_REPO_PATH = re.compile(
    r"`(?P<path>(?:celery_fence|sql|tests|benchmarks|scripts|docs|example_app|\.ci)/[\w./-]*"
    r"|[\w-]+\.(?:toml|yml|md))`"
)


def test_the_developers_guide_names_what_the_repository_has() -> None:
    """Every file and directory DEVELOPERS.md names exists, and its links resolve."""
    text = DEVELOPERS.read_text(encoding="utf-8")
    named = {match["path"] for match in _REPO_PATH.finditer(text)}
    assert {"scripts/test", "tests/conftest.py", "sql/schema.sql", "pyproject.toml"} <= named
    missing = sorted(
        path for path in named if "NNNN" not in path and not (ROOT / path.split()[0]).exists()
    )
    linked = [target.partition("#")[0] for target in links(DEVELOPERS)]
    missing += [target for target in linked if not (ROOT / target).exists()]
    assert not missing, missing


def test_the_docs_have_runnable_pages() -> None:
    """The page runner has something to run: the quickstart and the how-tos at least."""
    names = {page.relative_to(DOCS).as_posix() for page in RUNNABLE}
    assert {"quickstart.md", "how-to/guard-your-writes.md", "how-to/fence-a-task.md"} <= names


# -- what is not run here ----------------------------------------------------------------------


def test_markers_are_known_and_mark_something_runnable() -> None:
    wrong = []
    for block in all_blocks():
        if block.marker is None or not block.marker.startswith(
            ("run", "file", "grants", "meanwhile")
        ):
            continue
        if not KNOWN_MARKERS.match(block.marker):
            wrong.append(f"{block.where}: unknown marker <!-- {block.marker} -->")
        elif block.marker == "run" and block.language not in {"python", "sql", *SHELL_LANGUAGES}:
            wrong.append(f"{block.where}: <!-- run --> before a {block.language!r} block")
    assert not wrong, "\n".join(wrong)


def test_every_python_block_compiles() -> None:
    broken = []
    for block in all_blocks():
        if block.language == "python":
            try:
                ast.parse(block.body)
            except SyntaxError as exc:
                broken.append(f"{block.where}: {exc}")
    assert not broken, "\n".join(broken)


def pasted_fails(source: str) -> str | None:
    """What Python's interactive interpreter says, line by line, to ``source`` pasted into it,
    or ``None`` when it takes every line: there a blank line ends a compound statement (one
    inside a function's body ends the function), and a statement after one needs a blank line
    before it."""
    compiler = codeop.CommandCompiler()
    pending: list[str] = []
    for number, line in enumerate([*source.splitlines(), ""], start=1):
        pending.append(line)
        try:
            code = compiler("\n".join(pending), "<stdin>", "single")
        except SyntaxError as exc:
            return f"line {number}: {exc.msg}"
        if code is not None or not "".join(pending).strip():
            pending = []
    return None


def test_python_blocks_a_page_says_to_paste_into_python_paste_as_they_are() -> None:
    broken = []
    for page in pages():
        if "paste them in turn" not in page.read_text(encoding="utf-8"):
            continue
        for block in blocks(page):
            if block.language == "python" and (failure := pasted_fails(block.body)):
                broken.append(f"{block.where}: {failure}")
    assert not broken, "\n".join(broken)


def _runner_files(exclude: set[Path]) -> dict[Path, list[str]]:
    files = {
        path: _WORDS.findall(path.read_text(encoding="utf-8", errors="replace"))
        for pattern in RUNNER_GLOBS
        for path in ROOT.glob(pattern)
        if path.is_file() and path.resolve() != Path(__file__).resolve()
    }
    return {path: words for path, words in files.items() if path.resolve() not in exclude}


def _contains(words: list[str], wanted: list[str]) -> bool:
    size = len(wanted)
    return any(words[index : index + size] == wanted for index in range(len(words) - size + 1))


def where_run(command: Command) -> list[str]:
    """The files that run ``command``: its words in order, or its :data:`RUN_BY` entry. A
    file the command runs does not count as running itself."""
    text = _EXIT.sub("", command.text).replace("\\\n", " ")
    words = shlex.split(text, comments=True)
    named = {(ROOT / word).resolve() for word in words if (ROOT / word).is_file()}
    found = [
        str(path.relative_to(ROOT))
        for path, file_words in _runner_files(named).items()
        if _contains(file_words, words)
    ]
    normalized = " ".join(words)
    for start, (path, fragment) in RUN_BY.items():
        if normalized.startswith(start) and fragment in (ROOT / path).read_text(encoding="utf-8"):
            found.append(path)
    return found


def test_every_other_command_is_run_by_a_script_or_test() -> None:
    unrun = [
        f"{command.where}: $ {command.text}"
        for command in all_commands()
        if command.kind == "elsewhere" and not where_run(command)
    ]
    assert not unrun, (
        "no script or test runs these commands (add one, or an entry to RUN_BY):\n"
        + "\n".join(unrun)
    )


def test_run_by_entries_are_used_and_hold() -> None:
    """Each :data:`RUN_BY` entry names a file that still runs the command, for a command the
    docs still show."""
    shown = [" ".join(shlex.split(c.text, comments=True)) for c in all_commands()]
    for start, (path, fragment) in RUN_BY.items():
        assert fragment in (ROOT / path).read_text(encoding="utf-8"), (start, path)
        assert any(command.startswith(start) for command in shown), f"unused: {start}"


def test_delegated_pages_are_read_by_their_tests() -> None:
    for page, test in DELEGATED.items():
        assert (DOCS / page).is_file(), page
        assert Path(page).name in (ROOT / test).read_text(encoding="utf-8"), (page, test)


def test_install_commands_name_this_project_and_its_extras() -> None:
    project = metadata("celery-fence")
    extras = set(project.get_all("Provides-Extra") or [])
    checked = 0
    for command in all_commands():
        if command.kind != "install":
            continue
        for spec in shlex.split(command.text, comments=True)[2:]:
            if spec.startswith("-"):
                continue
            name, _, rest = spec.partition("[")
            assert name in (".", project["Name"]), f"{command.where}: installs {name!r}"
            wanted = set(filter(None, rest.rstrip("]").split(",")))
            assert wanted <= extras, f"{command.where}: no extra {wanted - extras} in {extras}"
            checked += 1
    assert checked, "the docs show no install command"


# -- links -------------------------------------------------------------------------------------


def _outside_fences(page: Path) -> list[str]:
    """The lines of ``page`` that are not in a fenced block."""
    lines, inside = [], None
    for line in page.read_text(encoding="utf-8").splitlines():
        match = _FENCE.match(line)
        if inside is None and match:
            inside = match["fence"]
        elif inside is not None and _closes(line, inside):
            inside = None
        elif inside is None:
            lines.append(line)
    return lines


def _prose(page: Path) -> str:
    """The page without its fenced blocks and inline code."""
    return "\n".join(_INLINE_CODE.sub("", line) for line in _outside_fences(page))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page``."""
    seen: dict[str, int] = {}
    result = set()
    for line in _outside_fences(page):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", match[1].replace("`", "").lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def links(page: Path) -> list[str]:
    return [
        match["target"]
        for match in _LINK.finditer(_prose(page))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", match["target"])
    ]


def test_relative_links_resolve() -> None:
    broken = []
    for page in pages():
        for target in links(page):
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(DOCS)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(DOCS)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_page_is_reachable_from_the_index() -> None:
    index = DOCS / "index.md"
    seen, todo = {index.resolve()}, [index]
    while todo:
        page = todo.pop()
        for target in links(page):
            path = (page.parent / target.partition("#")[0]).resolve()
            if path.suffix == ".md" and path not in seen and path.exists():
                seen.add(path)
                todo.append(path)
    orphans = [str(page.relative_to(DOCS)) for page in pages() if page.resolve() not in seen]
    assert not orphans, f"pages no link from index.md leads to: {orphans}"


# -- tables ------------------------------------------------------------------------------------

_TABLE_DELIMITER = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def test_every_table_has_a_header_and_a_delimiter_row() -> None:
    """A run of ``|`` lines renders as a table only under a header and a delimiter row: a row
    set apart from its table by a blank line shows as text."""
    broken = []
    for page in pages():
        rows: list[str] = []
        for line in [*_outside_fences(page), ""]:
            if line.startswith("|"):
                rows.append(line)
                continue
            if rows and (len(rows) < 2 or not _TABLE_DELIMITER.match(rows[1])):
                broken.append(f"{page.relative_to(DOCS)}: {rows[0]}")
            rows = []
    assert not broken, "\n".join(broken)


# -- the reference names everything ------------------------------------------------------------


def _reference(name: str) -> str:
    return (DOCS / "reference" / name).read_text(encoding="utf-8")


def _named(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text) is not None


def test_every_setting_is_documented_and_every_documented_setting_exists() -> None:
    text = _reference("configuration.md")
    documented = set(re.findall(r"^#+\s+`(fence_\w+)`", text, flags=re.MULTILINE))
    assert documented == set(DEFAULTS)
    for key, default in DEFAULTS.items():
        section = text.split(f"### `{key}`\n", 1)[1].split("\n#", 1)[0]
        assert f"Default: `{default!r}`" in section, f"{key}: its default {default!r}"


def test_the_docs_name_only_settings_that_exist() -> None:
    """In the prose, tables and examples that are not run (a run example that used an unknown
    key would fail on its own: unknown keys are rejected)."""
    unknown = set()
    for page in pages():
        texts = _outside_fences(page) + [
            block.body for block in blocks(page) if block.marker != "run"
        ]
        for name in re.findall(r"(?<![\w.])fence_[a-z_]*[a-z*]", "\n".join(texts)):
            prefix = name.removesuffix("*")
            if name.endswith("*") and any(key.startswith(prefix) for key in DEFAULTS):
                continue
            if name not in DEFAULTS:
                unknown.add(f"{page.relative_to(DOCS)}: {name}")
    assert not unknown, sorted(unknown)


def _parameters(function: Any) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name not in ("self", "cls")]


def _public_api() -> dict[str, list[str]]:
    """Every public name; for the classes a user calls or reads, their public methods and
    properties, the parameters of each, and the fields of each model and of the settings."""
    names: dict[str, list[str]] = {
        name: [] for name in [*celery_fence.__all__, *fence_celery.__all__]
    }
    for cls in (LeaseStore, Fence, FencedRun, FencedScheduler):
        members = {
            name: getattr(member, "__func__", member)
            for name, member in vars(cls).items()
            if not name.startswith("_")
            and isinstance(member, (property, classmethod, staticmethod, FunctionType))
        }
        names[cls.__name__] = [*members, *_parameters(cls.__init__)]
        for name, member in members.items():
            if inspect.isfunction(member):
                names[f"{cls.__name__}.{name}"] = _parameters(member)
    for model in (
        models.Lease,
        models.Owner,
        models.Acquisition,
        models.StaleRun,
        models.HistoryEntry,
        models.Dispatch,
        FenceSettings,
    ):
        names[model.__name__] = [field.name for field in dataclasses.fields(model)]
    return names


def test_the_api_reference_names_every_public_name() -> None:
    text = _reference("api.md")
    missing = [
        f"{owner}: {name}"
        for owner, members in _public_api().items()
        for name in [owner.rpartition(".")[2], *members]
        if not _named(text, name)
    ]
    assert not missing, missing


def _defined_names() -> set[str]:
    """The names the package's modules define at their top level."""
    names = set()
    for path in Path(celery_fence.__file__).parent.rglob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


def _api_names() -> Iterator[tuple[str, str, bool]]:
    """The classes and constants ``api.md`` names, as ``(module, name, written with it)``: the
    module the text writes a name with, else the one of its section (the package in its ``##``
    heading, or the module a ``###`` section opens with, as ``celery_fence.keeper.LeaseKeeper``
    does: its heading's names are that module's too)."""
    section = module = ""
    heading: str | None = None
    for line in _outside_fences(DOCS / "reference" / "api.md"):
        if line.startswith("## "):
            section = module = re.findall(r"`([\w.]+)`", line)[0]
        elif line.startswith("### "):
            heading = line
            continue
        elif heading is not None and line.strip():
            opening = re.match(r"`(celery_fence(?:\.\w+)*)\.[A-Z]", line)
            module = opening[1] if opening else section
            line, heading = f"{heading}\n{line}", None
        elif not section:
            continue  # the page's introduction, which names what the sections hold
        for code in re.findall(r"`([\w.]+)", line):
            qualified = re.fullmatch(r"(celery_fence(?:\.\w+)*)\.([A-Z]\w*).*", code)
            if qualified:
                yield qualified[1], qualified[2], True
            elif code[:1].isupper():
                yield module, code.split(".")[0], False


def test_every_name_the_api_reference_names_is_importable_from_where_it_says() -> None:
    """A class or constant written with its module is importable from that module. One of
    this package's written without is importable from its section's module, or from another
    the page has a section for (``Fence`` named in the core's section, say); other libraries'
    names (``Engine``, ``ChordError``) are left out."""
    names = list(_api_names())
    sections = {module: None for module, _, written_with_it in names if not written_with_it}
    defined = _defined_names()
    wrong = []
    for module, name, written_with_it in names:
        if written_with_it:
            places = [module]
        elif name in defined:
            places = list(dict.fromkeys([module, *sections]))
        else:
            continue
        if not any(hasattr(importlib.import_module(place), name) for place in places):
            wrong.append(f"{name} (from {' or '.join(places)})")
    assert not wrong, sorted(set(wrong))


def _sql_objects() -> dict[str, list[str]]:
    """Every object the SQL files create, and each function's parameters."""
    objects: dict[str, list[str]] = {}
    sql = ROOT / "sql"
    for path in [*sql.glob("*.sql"), *sql.glob("migrations/*.sql")]:
        text = path.read_text(encoding="utf-8")
        pattern = (
            r"CREATE\s+(?:OR\s+REPLACE\s+)?(?:UNIQUE\s+)?(FUNCTION|TABLE|TYPE|INDEX|SCHEMA)"
            r"\s+(?:IF\s+NOT\s+EXISTS\s+)?([\w.]+)"
        )
        for match in re.finditer(pattern, text):
            name = match[2].removeprefix("celery_fence.")
            parameters: list[str] = []
            if match[1] == "FUNCTION":
                header = text[match.end() : text.index(")", match.end())]
                parameters = re.findall(r"\b(p_\w+)\b", header)
            objects[name] = parameters
    return objects


def test_the_sql_reference_names_every_object() -> None:
    text = _reference("sql.md")
    objects = _sql_objects()
    assert {"acquire", "fence", "leases", "stale_runs", "answer"} <= set(objects)
    missing = [
        f"{name}: {item}"
        for name, parameters in objects.items()
        for item in [name, *parameters]
        if not _named(text, item)
    ]
    assert not missing, missing


def _calls(attributes: set[str]) -> Iterator[ast.Call]:
    package = Path(celery_fence.__file__).parent
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and f"{ast.unparse(node.func.value)}.{node.func.attr}" in attributes
                and node.args
            ):
                yield node


def test_the_observability_reference_lists_every_log_message_and_counter() -> None:
    text = _reference("observability.md")
    levels = {"info", "warning", "error", "exception", "critical"}
    logged = {
        call.args[0].value
        for call in _calls(
            {f"{logger}.{level}" for logger in ("log", "stale_log") for level in levels}
        )
        if isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)
    }
    counters = set()
    for call in _calls(
        {"self.metrics.incr", "self.store.metrics.incr", "self.fence.store.metrics.incr"}
    ):
        argument = call.args[0]
        if isinstance(argument, ast.Constant):
            counters.add(str(argument.value))
        elif isinstance(argument, ast.JoinedStr) and isinstance(argument.values[0], ast.Constant):
            counters.add(f"{argument.values[0].value}<")
    assert len(logged) > 15, logged
    assert len(counters) > 5, counters
    missing = [f"log message {m!r}" for m in logged if f"`{m}`" not in text]
    missing += [f"counter {c!r}" for c in counters if f"`{c}" not in text]
    assert not missing, missing
