"""The benchmarks run, against real services, and print every target with a measured ratio.

These are smoke runs with few rounds: the figures themselves come from full runs (see
docs/discussion/performance.md and docs/discussion/task-overhead.md), never from a timed test.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TARGET = re.compile(
    r"^(?P<name>.+?)\s+(?P<ratio>\d+\.\d+)\s+(?P<limit>[<>=]*\d+(\.\d+)?)\s+(PASS|MISS)$"
)
MACHINE_CPU = re.compile(r"^the machine, every process\s+plain\s+(\S+)\s+fenced\s+(\S+)\s")


@pytest.mark.parametrize(
    ("script", "options", "targets", "cpu_table"),
    [
        (
            "benchmarks/bench_protocol.py",
            ["--rounds", "20", "--warmup", "2", "--race-every", "10"],
            5,
            False,
        ),
        (
            "benchmarks/bench_tasks.py",
            ["--tasks", "20", "--batch", "5", "--rounds", "1", "--warmup", "2"],
            2,
            True,
        ),
    ],
)
def test_the_benchmark_measures_every_target(
    database_url: str, script: str, options: list[str], targets: int, cpu_table: bool
) -> None:
    server = database_url.rsplit("/", 1)[0] + "/postgres"
    done = subprocess.run(
        [sys.executable, str(REPO / script), "--database-url", server, *options],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = [m for line in done.stdout.splitlines() if (m := TARGET.match(line.strip()))]
    assert len(found) == targets, [match["name"] for match in found]
    assert all(float(match["ratio"]) > 0 for match in found)
    if cpu_table and Path("/proc/stat").exists():
        machine = [m for line in done.stdout.splitlines() if (m := MACHINE_CPU.match(line.strip()))]
        assert len(machine) == 1, done.stdout
        plain, fenced = (float(value) for value in machine[0].groups())
        assert plain > 0
        assert fenced > 0
    elif cpu_table:
        assert "not measured: this system has no /proc" in done.stdout
