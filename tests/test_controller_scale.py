"""Benchmark 12 (controller CPU by world size) runs in smoke mode and leaves nothing running, and
the 1,024-GPU model in benchmarks/scale_model.py derives its figures as docs/design/scale.md says.

Nothing here asserts anything about speed."""
from __future__ import annotations

import json
import uuid

import pytest

from benchmarks.scale_model import Cluster, Measured, fit_line, model
from test_benchmarks_smoke import run_marked, survivors_after_grace

TIMEOUT_S = 120


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_controller_scale_runs_in_smoke_mode(tmp_path):
    token = uuid.uuid4().hex
    try:
        finished = run_marked(["-m", "benchmarks", "--smoke", "--only", "controller_scale", "--out", str(tmp_path)],
                              token, TIMEOUT_S, "benchmark")
    finally:
        survivors = survivors_after_grace(token)
    rows = json.loads((tmp_path / "latest.json").read_text())["rows"]
    assert finished.returncode == 0, finished.stdout[-3000:]
    assert not survivors, f"processes left running (killed now): {survivors}"
    assert all(r["status"] == "ok" and r["samples"] for r in rows), rows
    # every world size: the program with workers running, paused while issuing, two reads, idle
    assert len(rows) == 5 * 2
    assert {r["variant"] for r in rows} == {"dtorch, 1 worker", "dtorch, 2 workers"}


def test_fit_line_recovers_a_line():
    assert fit_line([1, 4, 16, 64], [3 + 2 * x for x in (1, 4, 16, 64)]) == pytest.approx((3.0, 2.0))
    assert fit_line([5, 5], [1.0, 3.0]) == pytest.approx((2.0, 0.0))   # one x: no slope to fit


def _measured(**changes) -> Measured:
    values = dict(op_cpu_s=10e-6, op_cpu_per_subscriber_s=10e-9, read_wall_s=0.4e-3, read_wall_per_rank_s=40e-6,
                  read_wall_slope_here_s=300e-6, heartbeat_cpu_s=150e-6, heartbeat_bytes=36, pong_bytes=5,
                  heartbeat_interval_s=0.5, bytes_per_op=40.0, hop_s=30e-6)
    values.update(changes)
    return Measured(**values)


def test_model_of_1024_gpus():
    derived = model(_measured(), Cluster(hosts=128, gpus_per_host=8, nic_gbps=100, network_rtt_s=20e-6))
    no_relays, relays = derived["no_relays"], derived["relays"]
    assert derived["workers"] == 1024
    assert no_relays["commands_per_s"] == pytest.approx(1 / (10e-6 + 1024 * 10e-9))
    assert relays["commands_per_s"] == pytest.approx(1 / (10e-6 + 128 * 10e-9))
    assert no_relays["bytes_per_op_per_host"] == 8 * 40 and relays["bytes_per_op_per_host"] == 40
    assert no_relays["read_floor_ms"] == pytest.approx(1e3 * (0.4e-3 + 1024 * 40e-6 + 20e-6))
    assert relays["read_floor_ms"] < no_relays["read_floor_ms"]
    assert derived["heartbeats"]["per_s"] == 2048
    assert derived["heartbeats"]["controller_core_share"] == pytest.approx(2048 * 150e-6)
    breaks = derived["breaks"]
    assert [b["workers"] for b in breaks] == sorted(b["workers"] for b in breaks)
    fan_out = next(b for b in breaks if "doubles" in b["what"])
    assert fan_out["workers"] == pytest.approx(1000)
    assert set(derived["pathways"]) == {"128", "2048"}


def test_model_without_a_per_subscriber_cost_never_fills_the_nic():
    derived = model(_measured(op_cpu_per_subscriber_s=0.0), Cluster())
    nic = next(b for b in derived["breaks"] if "NIC" in b["what"])
    # 40 B x N subscribers x 100k commands/s reaches 12.5 GB/s at N = 3125
    assert nic["workers"] == pytest.approx(12.5e9 * 10e-6 / 40)
