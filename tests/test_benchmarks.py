"""Smoke tests of the scripts in benchmarks/ that run on a CPU (gloo and the reference path)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| tiny-cpu")]


def test_ep_scaling_writes_one_table_for_its_runs(tmp_path):
    """benchmarks/ep_scaling.py on two CPU processes: EP 1 and EP 2 rows with host and device splits at
    each chunk count, in one table written to --out."""
    out = tmp_path / "ep.md"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    env.pop("TRITON_INTERPRET", None)  # (the reference path: the interpreter would take minutes)
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ep_scaling.py"), "--reps", "1",
                          "--warmup", "0", "--chunks", "1", "--chunks", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(out.read_text())
    got = {(r[3], r[4], r[5]) for r in rows}  # (EP, splits, chunks)
    assert got == {("1", "-", "-"), ("2", "host", "1"), ("2", "host", "2"), ("2", "device", "2")}, got
    assert all(float(r[7]) > 0 for r in rows)  # step ms
