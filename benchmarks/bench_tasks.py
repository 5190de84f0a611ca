"""Plain and fenced Celery tasks, end to end, through a real prefork worker on a real broker.

    .venv/bin/python benchmarks/bench_tasks.py [--database-url URL] [--broker URL] [--tasks N]

Both tasks run the same body, one ``UPDATE`` of a row in its own transaction. The plain task is
a regular ``@app.task``; the fenced one is ``@fence.task`` with a lease per run (acquired when it
starts, renewed in the background, released when it ends) and its body under ``fence.guard``.

Creates a scratch database (``bench_tasks_...``) on the server, installs celery-fence there, and
drops it at the end; the broker queue is the run's own and is deleted at the end. Results go to
``--backend`` (by default the broker when it is Redis). Two phases, plain and fenced
interleaved in each:

- latency: a worker with concurrency 1; batches of ``--batch`` tasks, one at a time (send,
  then ``result.get()``), alternating plain and fenced batches: median and p90 per task;
- throughput: a worker with concurrency 2; ``--tasks`` tasks sent at once, timed until every
  result is in, ``--rounds`` rounds alternating which kind goes first: the median rate, and
  the median of each round's fenced / plain ratio (so that load drifting between rounds
  cancels out).

It prints both with the targets (fenced latency at most 1.3x plain, fenced throughput at least
0.75x plain) marked PASS or MISS; where the time goes, from timings the worker processes take
around each task and its body; and, on Linux, where the CPU goes in the throughput phase, per
task and by process (the client, the worker's parent and children, the scratch database's
PostgreSQL backends, ...), from ``/proc``. With ``--check`` a miss makes the exit status non-zero.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date
from pathlib import Path
from typing import Any

import celery
import sqlalchemy as sa
from celery import Celery, signals
from celery.result import AsyncResult
from kombu import Exchange, Queue
from sqlalchemy.engine import make_url

from bench_common import (
    Samples,
    add_database_url,
    percentile,
    scratch_database,
    server_version,
)
from celery_fence import LeaseStore
from celery_fence.contrib.celery import Fence
from celery_fence.keeper import LeaseKeeper

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_BROKER = "redis://127.0.0.1:6379/0"
LATENCY_LIMIT = 1.3
THROUGHPUT_LIMIT = 0.75
READY_TIMEOUT = 60.0
RESULT_TIMEOUT = 60.0
KINDS = ("plain", "fenced")

app = Celery("bench", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("BENCH_BROKER_URL"),
    result_backend=os.environ.get("BENCH_RESULT_BACKEND"),
    fence_database_url=os.environ.get("BENCH_DATABASE_URL"),
    fence_on_busy="raise",  # a busy lease would mean the benchmark is wrong: fail loudly
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench"),
    worker_enable_remote_control=False,
    worker_send_task_events=False,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)
fence = Fence(app)
UPDATE = sa.text("UPDATE bench_rows SET hits = hits + 1 WHERE id = :row")

# -- in the worker: the tasks, and timings around each task and its body -------------------------

_timings: dict[str, list[float]] = defaultdict(list)
_started: dict[str, float] = {}


@contextmanager
def timed(key: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    _timings[key].append(time.perf_counter() - started)


@app.task(name="bench.plain")
def plain(row: int) -> None:
    with timed("body.plain"), fence.store.engine.begin() as conn:
        conn.execute(UPDATE, {"row": row})


@fence.task(name="bench.fenced", lease="bench:{row}", ttl=30)
def fenced(row: int) -> None:
    with timed("body.fenced"), fence.guard("bench update") as conn:
        conn.execute(UPDATE, {"row": row})


TASKS = {"plain": plain, "fenced": fenced}


@signals.task_prerun.connect
def _task_started(task_id: str, **_: Any) -> None:
    _started[task_id] = time.perf_counter()


@signals.task_postrun.connect
def _task_ended(task_id: str, task: Any, **_: Any) -> None:
    kind = task.name.rsplit(".", 1)[-1]
    _timings[f"worker.{kind}"].append(time.perf_counter() - _started.pop(task_id))


@signals.worker_process_shutdown.connect
def _write_timings(**_: Any) -> None:
    directory = os.environ.get("BENCH_TIMINGS_DIR")
    if directory:
        Path(directory, f"{os.getpid()}.json").write_text(json.dumps(_timings))


@signals.worker_process_init.connect
def _time_lease_calls(**_: Any) -> None:
    """Time what a fenced run adds around its body: acquire and release, and starting and
    stopping its renewal thread."""
    for owner, name in (
        (fence.store, "acquire"),
        (fence.store, "release"),
        (LeaseKeeper, "start"),
        (LeaseKeeper, "stop"),
    ):
        setattr(owner, name, _timing(f"lease.{name}", getattr(owner, name)))


def _timing(key: str, call: Callable[..., Any]) -> Callable[..., Any]:
    def timed_call(*args: Any, **kwargs: Any) -> Any:
        with timed(key):
            return call(*args, **kwargs)

    return timed_call


@signals.worker_ready.connect
def _announce_ready(**_: Any) -> None:
    Path(os.environ["BENCH_READY_FILE"]).touch()


# -- in the benchmark process ---------------------------------------------------------------------


@contextmanager
def bench_database(server_url: str, rows: int) -> Iterator[str]:
    """A scratch database with the benchmark's table of ``rows`` rows; its URL."""
    with scratch_database(server_url, "bench_tasks") as url:
        engine = sa.create_engine(url, poolclass=sa.NullPool)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TABLE bench_rows (id integer PRIMARY KEY, hits bigint NOT NULL);"
                f"INSERT INTO bench_rows SELECT i, 0 FROM generate_series(0, {rows - 1}) i"
            )
        engine.dispose()
        yield url.render_as_string(hide_password=False)


@contextmanager
def worker(env: dict[str, str], concurrency: int, timings: Samples | None = None) -> Iterator[int]:
    """A prefork worker process on the run's queue; yields its pid. Its processes' timings are
    added to ``timings``, if given, when it has stopped."""
    with tempfile.TemporaryDirectory(prefix="bench-tasks-") as scratch:
        ready = Path(scratch, "ready")
        log = Path(scratch, "worker.log")
        env = {
            **env,
            "BENCH_READY_FILE": str(ready),
            "BENCH_TIMINGS_DIR": scratch,
            # The worker imports this module as benchmarks.bench_tasks, and it bench_common.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])),
        }
        command = [
            sys.executable, "-m", "celery", "-A", "benchmarks.bench_tasks", "worker",
            "--pool=prefork", f"--concurrency={concurrency}", "--loglevel=WARNING",
            "--without-mingle", "--without-gossip", "--without-heartbeat",
        ]  # fmt: skip
        with log.open("wb") as out:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)
        try:
            deadline = time.monotonic() + READY_TIMEOUT
            while not ready.exists():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the worker did not start:\n{log.read_text()}")
                time.sleep(0.05)
            yield process.pid
        finally:
            process.terminate()
            process.wait(30)
        if timings is None:
            return
        for path in Path(scratch).glob("*.json"):
            for key, values in json.loads(path.read_text()).items():
                timings[key].extend(values)


def send(kind: str, row: int) -> AsyncResult:
    return TASKS[kind].apply_async((row,))


def wait(result: AsyncResult) -> None:
    result.get(timeout=RESULT_TIMEOUT)


def interleaved(round_number: int) -> tuple[str, ...]:
    """Which kind goes first alternates, so that drift falls on both alike."""
    return KINDS if round_number % 2 == 0 else KINDS[::-1]


def measure_latency(tasks: int, batch: int, warmup: int) -> Samples:
    samples: Samples = {kind: [] for kind in KINDS}
    for kind in KINDS:
        for index in range(warmup):
            wait(send(kind, index))
    for round_number in range(math.ceil(tasks / batch)):
        for kind in interleaved(round_number):
            for index in range(batch):
                started = time.perf_counter()
                wait(send(kind, index))
                samples[kind].append(time.perf_counter() - started)
    return samples


CpuUse = dict[str, dict[str, float]]
PROC = Path("/proc")
CPU_GROUPS = (
    ("client", "the benchmark process (sends, collects results)"),
    ("parent", "the worker's parent process (consumes, dispatches)"),
    ("children", "the worker's child processes (run the tasks)"),
    ("backends", "PostgreSQL: the scratch database's backends"),
    ("postgres", "PostgreSQL: its other processes"),
    ("broker", "Redis and RabbitMQ servers"),
    ("other", "everything else"),
    ("machine", "the machine, every process"),
)


class CpuMeter:
    """CPU time used by the processes of a run, by group, read from ``/proc`` (Linux only; the
    groups need the services on this machine): the benchmark itself, the worker's parent and
    children, the scratch database's PostgreSQL backends, PostgreSQL's other processes, the
    Redis and RabbitMQ servers, everything else, and the whole machine."""

    def __init__(self, worker_pid: int, database: str) -> None:
        self.worker_pid = worker_pid
        self.backend_marker = f" {database} ".encode()
        self.available = Path(PROC, "stat").exists()

    def snapshot(self) -> dict[int | str, tuple[str, int]]:
        """Clock ticks used so far: by pid (with its group), and by the machine."""
        ticks: dict[int | str, tuple[str, int]] = {}
        for entry in PROC.iterdir():
            if entry.name.isdigit():
                found = self._process(int(entry.name))
                if found is not None:
                    ticks[int(entry.name)] = found
        fields = Path(PROC, "stat").read_text().split("\n", 1)[0].split()[1:]
        # user nice system idle iowait irq softirq steal: what this machine's processes and
        # interrupts used, without idle, iowait and the steal time other guests had
        ticks["machine"] = ("machine", sum(int(fields[i]) for i in (0, 1, 2, 5, 6)))
        return ticks

    def used(self, before: dict[int | str, tuple[str, int]]) -> dict[str, float]:
        """CPU seconds by group since ``before``; a process that started since counts from
        zero, one that ended is left out."""
        tick = os.sysconf("SC_CLK_TCK")
        seconds: dict[str, float] = defaultdict(float)
        for key, (group, now) in self.snapshot().items():
            seconds[group] += (now - before.get(key, (group, 0))[1]) / tick
        seconds["other"] = seconds["machine"] - sum(
            value for group, value in seconds.items() if group != "machine"
        )
        return seconds

    def _process(self, pid: int) -> tuple[str, int] | None:
        try:
            stat = Path(PROC, str(pid), "stat").read_bytes()
            command = Path(PROC, str(pid), "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # the process ended meanwhile
            return None
        name, _, rest = stat.partition(b" (")[2].rpartition(b") ")
        fields = rest.split()
        parent = int(fields[1])
        if pid == os.getpid():
            group = "client"
        elif pid == self.worker_pid:
            group = "parent"
        elif parent == self.worker_pid:
            group = "children"
        elif name == b"postgres":
            group = "backends" if self.backend_marker in command else "postgres"
        elif name in (b"redis-server", b"beam.smp"):
            group = "broker"
        else:
            return None
        return group, int(fields[11]) + int(fields[12])  # utime + stime


def measure_throughput(
    tasks: int, rounds: int, warmup: int, cpu: CpuMeter
) -> tuple[Samples, CpuUse | None]:
    """Tasks per second, one value per round and kind, and the CPU time each kind's rounds
    used, by process group (``None`` without ``/proc``). The tasks of a round each have a row
    (and a lease) of their own, so that no two tasks running at once want the same lease."""
    samples: Samples = {kind: [] for kind in KINDS}
    used: CpuUse = {kind: defaultdict(float) for kind in KINDS}
    for kind in KINDS:
        for result in [send(kind, index) for index in range(warmup)]:
            wait(result)
    for round_number in range(rounds):
        for kind in interleaved(round_number):
            before = cpu.snapshot() if cpu.available else {}
            started = time.perf_counter()
            for result in [send(kind, index) for index in range(tasks)]:
                wait(result)
            samples[kind].append(tasks / (time.perf_counter() - started))
            if cpu.available:
                for group, seconds in cpu.used(before).items():
                    used[kind][group] += seconds
    return samples, (used if cpu.available else None)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(
    latency: Samples, throughput: Samples, timings: Samples, cpu: CpuUse | None, tasks: int
) -> bool:
    """Print the tables, the targets and the breakdowns; return whether both targets were met."""
    print_measurements(latency, throughput)
    met = print_targets(latency, throughput)
    print_breakdown(latency, timings)
    print_cpu(cpu, {kind: tasks * len(throughput[kind]) for kind in KINDS})
    return met


def print_measurements(latency: Samples, throughput: Samples) -> None:
    heading = "latency, concurrency 1 (send -> result)"
    print(f"\n{heading:<44} {'n':>5} {'median ms':>9} {'p90 ms':>8}")
    for kind in KINDS:
        print(
            f"  {kind:<42} {len(latency[kind]):>5} {ms(statistics.median(latency[kind])):>9}"
            f" {ms(percentile(latency[kind], 0.9)):>8}"
        )
    print(f"\n{'throughput, concurrency 2 (tasks/s)':<44} {'rounds':>6} {'median':>8} {'min':>8}")
    for kind in KINDS:
        print(
            f"  {kind:<42} {len(throughput[kind]):>6} {statistics.median(throughput[kind]):>8.0f}"
            f" {min(throughput[kind]):>8.0f}"
        )


def print_targets(latency: Samples, throughput: Samples) -> bool:
    """The two targets, PASS or MISS; the throughput ratio is the median of each round's."""
    latency_ratio = statistics.median(latency["fenced"]) / statistics.median(latency["plain"])
    p90_ratio = percentile(latency["fenced"], 0.9) / percentile(latency["plain"], 0.9)
    per_round = [
        fenced / plain
        for plain, fenced in zip(throughput["plain"], throughput["fenced"], strict=True)
    ]
    throughput_ratio = statistics.median(per_round)
    latency_met = latency_ratio <= LATENCY_LIMIT
    throughput_met = throughput_ratio >= THROUGHPUT_LIMIT
    print(f"\n{'target':<44} {'ratio':>6} {'limit':>6}")
    print(
        f"{'fenced / plain latency (median)':<44} {latency_ratio:>6.2f} "
        f"{'<=' + str(LATENCY_LIMIT):>6}  {verdict(latency_met)}"
    )
    print(f"{'fenced / plain latency (p90), for reference':<44} {p90_ratio:>6.2f}")
    print(
        f"{'fenced / plain throughput (median per round)':<44} {throughput_ratio:>6.2f} "
        f"{'>=' + str(THROUGHPUT_LIMIT):>6}  {verdict(throughput_met)}"
    )
    print(f"  per round: {' '.join(f'{ratio:.2f}' for ratio in per_round)}")
    return latency_met and throughput_met


def print_breakdown(latency: Samples, timings: Samples) -> None:
    """Where a task's time goes, from the latency phase's worker timings."""
    print("\nwhere the time goes (medians per task in the latency phase, ms)")
    median, worker, body = (
        {kind: statistics.median(samples[kind]) for kind in KINDS}
        for samples in (
            latency,
            {kind: timings[f"worker.{kind}"] for kind in KINDS},
            {kind: timings[f"body.{kind}"] for kind in KINDS},
        )
    )
    acquire, release, start, stop = (
        statistics.median(timings[f"lease.{call}"])
        for call in ("acquire", "release", "start", "stop")
    )
    for label, plain_value, fenced_value in (
        ("end to end, concurrency 1", median["plain"], median["fenced"]),
        ("in the worker process: task_prerun -> task_postrun", worker["plain"], worker["fenced"]),
        ("  the body's transaction (fenced: under fence.guard)", body["plain"], body["fenced"]),
        ("  LeaseStore.acquire", 0.0, acquire),
        ("  LeaseStore.release", 0.0, release),
        ("  starting and stopping the LeaseKeeper", 0.0, start + stop),
        (
            "  the rest (Celery's tracing and result; fenced: run bookkeeping)",
            worker["plain"] - body["plain"],
            worker["fenced"] - body["fenced"] - acquire - release - start - stop,
        ),
        (
            "outside the worker process (broker, result backend, client)",
            median["plain"] - worker["plain"],
            median["fenced"] - worker["fenced"],
        ),
    ):
        print_difference(label, plain_value, fenced_value)


def print_cpu(cpu: CpuUse | None, sent: dict[str, int]) -> None:
    """CPU time per task in the throughput phase, by process group."""
    print("\nCPU time per task in the throughput phase (ms, all rounds, from /proc)")
    if cpu is None:
        print("  not measured: this system has no /proc")
        return
    for group, label in CPU_GROUPS:
        plain, fenced = (cpu[kind][group] / sent[kind] for kind in KINDS)
        print_difference(label, plain, fenced)


def print_difference(label: str, plain: float, fenced: float) -> None:
    """One line of a breakdown: the plain and fenced figures (seconds, shown in ms) and their
    difference."""
    print(
        f"  {label:<66} plain {ms(plain):>6}  fenced {ms(fenced):>6}"
        f"  {(fenced - plain) * 1000:>+7.2f}"
    )


def describe(database_url: str, broker: str, args: argparse.Namespace) -> str:
    version = server_version(make_url(database_url).set(drivername="postgresql+psycopg"))
    return (
        f"celery-fence task benchmark, {date.today()}: PostgreSQL {version}, broker "
        f"{make_url(broker).drivername if '://' in broker else broker}, Python "
        f"{platform.python_version()}, Celery {celery.__version__}, {os.cpu_count()} cores; "
        f"latency {args.tasks} tasks of each kind in batches of {args.batch}, throughput "
        f"{args.rounds} rounds of {args.tasks} tasks of each kind"
    )


def delete_queue(name: str) -> None:
    """Delete the run's queue and its exchange (Celery declares one of the same name)."""
    with app.connection_for_write() as conn:
        queue = Queue(name, Exchange(name), routing_key=name).bind(conn.default_channel)
        queue.declare()  # so that the channel knows the bindings the queue takes along
        queue.delete()
        queue.exchange.delete()


def check_rows(database_url: str, expected: int) -> None:
    """Every task that reported success made its update."""
    store = LeaseStore.from_url(database_url)
    with store.engine.connect() as conn:
        hits = conn.exec_driver_sql("SELECT sum(hits) FROM bench_rows").scalar()
    store.engine.dispose()
    assert hits == expected, f"{hits} updates for {expected} tasks"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_database_url(parser)
    parser.add_argument(
        "--broker", default=os.environ.get("CELERY_FENCE_BROKER_URL", DEFAULT_BROKER)
    )
    parser.add_argument(
        "--backend", help="the result backend (default: the broker when it is Redis, else Redis)"
    )
    parser.add_argument(
        "--tasks", type=int, default=300, help="tasks of each kind per phase (default 300)"
    )
    parser.add_argument("--batch", type=int, default=10, help="latency batch size (default 10)")
    parser.add_argument("--rounds", type=int, default=5, help="throughput rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured tasks of each kind")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    backend = args.backend or (args.broker if args.broker.startswith("redis") else DEFAULT_BROKER)
    queue = f"bench-tasks-{uuid.uuid4().hex[:12]}"
    timings: Samples = defaultdict(list)

    print(describe(args.database_url, args.broker, args), flush=True)
    with bench_database(args.database_url, max(args.tasks, args.warmup, args.batch)) as url:
        env = {
            **os.environ,
            "BENCH_DATABASE_URL": url,
            "BENCH_BROKER_URL": args.broker,
            "BENCH_RESULT_BACKEND": backend,
            "BENCH_QUEUE": queue,
        }
        app.conf.update(
            broker_url=args.broker,
            result_backend=backend,
            task_default_queue=queue,
            fence_database_url=url,
        )
        started = time.monotonic()
        try:
            with worker(env, 1, timings):
                latency = measure_latency(args.tasks, args.batch, args.warmup)
            with worker(env, 2) as pid:
                meter = CpuMeter(pid, make_url(url).database or "")
                throughput, cpu = measure_throughput(args.tasks, args.rounds, args.warmup, meter)
        finally:
            delete_queue(queue)
        sent = 2 * (args.warmup + args.batch * math.ceil(args.tasks / args.batch))
        sent += 2 * (args.warmup + args.rounds * args.tasks)
        check_rows(url, sent)
        print(f"measured in {time.monotonic() - started:.0f} s")
    met = report(latency, throughput, timings, cpu, args.tasks)
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main())
