"""The benchmarks run, against real services, and print every target with a measured ratio.

These are smoke runs with few rounds: the figures themselves come from full runs (see
docs/discussion/performance.md and docs/discussion/task-overhead.md), never from a timed test.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = re.compile(
    r"^(?P<name>.+?)\s+(?P<ratio>\d+\.\d+)\s+(?P<limit>[<>=]*\d+(\.\d+)?)\s+(PASS|MISS)$"
)


def run_benchmark(script: str, *args: str) -> list[re.Match[str]]:
    done = subprocess.run(
        [sys.executable, str(REPO / script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [m for line in done.stdout.splitlines() if (m := TARGET.match(line.strip()))]


def test_the_protocol_benchmark_measures_every_target(database_url: str) -> None:
    server = database_url.rsplit("/", 1)[0] + "/postgres"
    targets = run_benchmark(
        "benchmarks/bench_protocol.py",
        "--database-url",
        server,
        "--rounds",
        "20",
        "--warmup",
        "2",
        "--race-every",
        "10",
    )
    names = [match["name"] for match in targets]
    assert len(names) == 5, names
    assert all(float(match["ratio"]) > 0 for match in targets)


def test_the_task_benchmark_measures_every_target(database_url: str) -> None:
    server = database_url.rsplit("/", 1)[0] + "/postgres"
    targets = run_benchmark(
        "benchmarks/bench_tasks.py",
        "--database-url",
        server,
        "--tasks",
        "20",
        "--batch",
        "5",
        "--rounds",
        "1",
        "--warmup",
        "2",
    )
    assert len(targets) == 2, [match["name"] for match in targets]
    assert all(float(match["ratio"]) > 0 for match in targets)
