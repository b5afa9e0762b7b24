"""The short version of the chaos soak (harness/chaos.py, docs/jetstream.md "Chaos soak"): agents on two
mesh processes over a three-node NATS cluster, and agents of a far mesh sending to them across an IOA
network, with mesh processes, agent hosts, NATS nodes and the IOA network killed with SIGKILL every few
seconds, checked from the stored record."""

from __future__ import annotations

import pytest

from harness.chaos import Plan, soak

# its own NATS cluster, mesh processes and far SQLite mesh, whatever INBOXMESH_TEST_STORE says: run once
# (the test command runs it in the real-model lane, after the scenario)
pytestmark = pytest.mark.store_independent


@pytest.mark.timeout(600)
def test_a_soak_with_processes_and_nats_nodes_killed_loses_duplicates_and_reorders_nothing(tmp_path):
    # 100 messages across IOA, each waiting for its receipt from the far side through the network's and
    # mesh process 0's restarts: 200 took 80 s here with 5 network and 3 mesh process 0 kills (a relay whose
    # connection task ended on a call it had cancelled itself got 165 of 500 through in 300 s before)
    # the sends spread over a minute: an idle machine sends them all in 10 s, between two faults; and at
    # least 8 faults (a busy CI machine, slow to start a killed process again, fitted 7 in that minute)
    report = soak(Plan(seed=11, agents=20, messages=1000, hosts=4, far_agents=2, far_messages=50,
                       fault_every_s=3.0, min_faults=8, duration_s=300, drain_s=90, pace_s=60,
                       work_dir=tmp_path / "soak"))
    print(report)  # whole, with each refusal's receipt detail (an assertion's message is cut short)
    assert report.accepted == 1100, ("every message was accepted in the end (retried by id through the faults)",
                                     report.examples["refused"])
    assert report.accepted_over_ioa == 100, "the far agents' crossed the IOA network"
    assert sum(n for kind, n in report.faults.items() if kind in ("mesh", "host", "nats", "ioa")) >= 8, report.faults
    assert (report.lost, report.consumed_twice, report.reordered) == (0, 0, 0), report.examples
    assert report.consumed + report.dead_lettered == report.accepted
    assert report.runs == 40 and (report.announces_missing, report.announces_twice) == (0, 0), report.examples
