"""The sharded layout end to end: two shard Prometheus servers, a global one federating from them, the same alerts.

The reference trainer runs on two "nodes" of one rank each (two torchrun agents on this machine, each with
its own node name; gloo). Rank 0 writes the file_sd target file, as on a real cluster. Two shard Prometheus
servers each keep the targets whose node hashes to them (``hashmod``, as `rankscope-mixin --layout sharded`
writes their configs) and evaluate the shard rules; the global server federates the generated match list
from both (``honor_labels``), evaluates every alert and sends them to the shipped Alertmanager, which pages
and calls the trainer's control endpoint. Everything is the generated layout with the e2e suite's short
`for`s and windows and 1 s intervals (tests/e2e/harness.py), only the addresses changed.

Beside them, a reference Prometheus evaluates the single-server rules on the same ranks (alerting nowhere):
each fault must fire the same alerts with the same labels on both, the global server at most one interval
per layer later (and the servers' phases), and a healthy run none on either.
"""

from __future__ import annotations

import hashlib
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from rankscope.mixin import cli
from rankscope.mixin.config import Tunables
from rankscope.mixin.layout import split
from rankscope.mixin.promql import NONFINITE_NODE_MAX

from devstack.jobs import TrainerJob, stop_process, torchrun
from devstack.monitoring import MonitoringStack, generate_rules, unix_time
from devstack.ports import Ports
from tests.e2e.harness import INTERVAL_SECONDS, LATENCIES, NPROC, RULE_SETTINGS, UNTIL_STOPPED, Stack, short_labels
from tests.support import WebhookSink

pytestmark = pytest.mark.e2e

SHARDS = 2
#: What the global server's alert may lag the reference's by: one interval per layer (the shard's
#: evaluation of a per-rank reduction, the federation scrape), one for each of the servers' unrelated
#: phases (the shard's scrape against the reference's, the global evaluation against the reference's),
#: and a second for a loaded machine.
LAYER_SLACK_SECONDS = 2 * INTERVAL_SECONDS + 2 * INTERVAL_SECONDS + 1.0
#: The straggler's first slow step: after the pause that lets every layer read both ranks (the run pauses at
#: step 31 or a little later, however fast the machine).
STRAGGLE_AT = 201
#: The per-rank compute rates the global server federates from the shards (what the imbalance alert reads).
COMPUTE_RATES = "run_rank:rankscope_compute_duration_seconds_sum:rate"
#: Goal (issue 32): federated series per rank on the global server.
FEDERATED_SERIES_PER_RANK = 25
#: Ranks per node of a large job (8 GPUs), for the per-rank share of the series read from one rank per node.
RANKS_PER_NODE = 8


def hashmod(value: str, modulus: int) -> int:
    """Prometheus's `hashmod` relabeling of one label value (the low 8 bytes of its MD5, big-endian)."""
    return int.from_bytes(hashlib.md5(value.encode()).digest()[8:], "big") % modulus


def nodes_one_per_shard() -> tuple[str, ...]:
    """A node name for each shard, in shard order: the first `node-<k>` that hashes to it."""
    return tuple(next(f"node-{k}" for k in range(100) if hashmod(f"node-{k}", SHARDS) == s) for s in range(SHARDS))


NODES = nodes_one_per_shard()


class TwoNodeJob(TrainerJob):
    """The trainer on len(NODES) nodes of one rank each: one torchrun agent per node (static rendezvous on
    this machine), each naming its node (RANKSCOPE_NODE) and serving rank r's metrics on base port + r."""

    def launch(self, master_port: int, max_restarts: int) -> subprocess.Popen:
        assert self.nproc == len(NODES), "one rank per node"
        self.agents: list[subprocess.Popen] = []
        for index, node in enumerate(NODES):
            target = [f"--nnodes={len(NODES)}", f"--node_rank={index}", *self.trainer_args]
            target += ["--set", f"metrics.base_port={self.metrics_base_port + index}"]
            log = self.output if index == 0 else self.out / f"torchrun-{node}.log"
            env = {"RANKSCOPE_NODE": node, "RANKSCOPE_RUN_ID": "trainer-test"}
            self.agents.append(torchrun(1, target, master_port, env, log=log, max_restarts=max_restarts))
        return self.agents[0]

    def close(self) -> int:
        for agent in self.agents[1:]:
            stop_process(agent)
        return super().close()


def _interval(config: dict[str, Any]) -> dict[str, Any]:
    interval = f"{INTERVAL_SECONDS}s"
    config["global"].update(scrape_interval=interval, scrape_timeout=interval, evaluation_interval=interval)
    for job in config["scrape_configs"]:
        job.pop("scrape_interval", None)
    return config


def shard_config(layout: Path, index: int, targets: Path) -> dict[str, Any]:
    """Generated shard `index`'s config, at the e2e interval, reading this run's target file."""
    config = _interval(yaml.safe_load((layout / "shard" / f"prometheus-{index}.yml").read_text()))
    config["rule_files"] = [str(layout / "shard" / "rules" / "*.yml")]
    for job in config["scrape_configs"]:
        for discovery in job.get("file_sd_configs", []):
            # The trainer's directory does not exist yet, so there is nothing to watch: read it every interval.
            discovery.update(files=[str(targets)], refresh_interval=config["global"]["scrape_interval"])
    return config


def global_config(layout: Path, shards: list[str], alertmanager: str) -> dict[str, Any]:
    """The generated global server's config, at the e2e interval, federating from `shards`."""
    config = _interval(yaml.safe_load((layout / "global" / "prometheus.yml").read_text()))
    config["rule_files"] = [str(layout / "global" / "rules" / "*.yml")]
    config["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [alertmanager]}]
    (federate,) = config["scrape_configs"]
    federate["static_configs"] = [{"targets": shards}]
    return config


def reference_config(config: dict[str, Any]) -> dict[str, Any]:
    """The reference server sees the fault but not the loop's answer to it: an alert whose action is under way
    is held back (its rule's `unless` on the applied action), and the global server's alert acts within a
    second, so a reference that kept the trainer's action counters could miss the alert it is there to show
    (it evaluates at its own phase, and the action may land first). Only the comparison server drops them."""
    for job in config["scrape_configs"]:
        if job["job_name"] == "rankscope":
            job["metric_relabel_configs"] = [
                {"source_labels": ["__name__"], "regex": "rankscope_control_actions_total", "action": "drop"}
            ]
    return config


class FederatedStack(Stack):
    """Shards, a global Prometheus, the shipped Alertmanager, a pager sink, a reference single server and
    (once started) the trainer on two nodes. Queries, alerts and waits (Stack's) go to the global server."""

    job_class = TwoNodeJob

    def __init__(self, workdir: Path, name: str, free_port_block: Any, engine: str = "prometheus") -> None:
        assert engine == "prometheus", "the sharded layout is Prometheus federation"
        self.workdir, self.engine, self.run_id = workdir, engine, f"e2e-{name}"
        self.started_at = time.time()
        self.pager = WebhookSink()
        self.trainer = None
        base = free_port_block(NPROC + 8)
        self.ports = Ports(prometheus=base, alertmanager=base + 1, control=base + 2, metrics=base + 4,
                           pager=self.pager.port)  # fmt: skip
        self._master_port = base + 3
        shard_ports = [base + NPROC + 4 + i for i in range(SHARDS)]
        self.token_file = workdir / "control-token"
        self.token_file.write_text(secrets.token_urlsafe(32) + "\n")
        self.token = self.token_file.read_text().strip()
        self.rule_settings = list(RULE_SETTINGS)
        out = workdir / "generated-sharded"
        assert cli.main(["--layout", "sharded", "--out", str(out), *(f"--set={s}" for s in RULE_SETTINGS)]) == 0
        layout = out / "prometheus" / "sharded"
        self._config_dir = layout / "global"  # Stack.rules: the alerting rules the global server was given
        targets = workdir / "trainer" / "targets.json"  # TrainerJob's file_sd path: rank 0 writes it
        interval = f"{INTERVAL_SECONDS}s"
        self.shards = [
            MonitoringStack(workdir / f"shard-{i}", Ports(prometheus=port, metrics=self.ports.metrics), NPROC,
                            alertmanager=False, interval=interval)
            for i, port in enumerate(shard_ports)
        ]  # fmt: skip
        self.reference = MonitoringStack(
            workdir / "single", Ports(prometheus=base + NPROC + 4 + SHARDS, metrics=self.ports.metrics), NPROC,
            alertmanager=False, interval=interval, config_dir=generate_rules(workdir / "generated", RULE_SETTINGS),
        )  # fmt: skip
        self.monitoring = MonitoringStack(
            workdir / "global", self.ports, NPROC, self.token_file, interval=interval, notify_within="500ms"
        )
        for index, shard in enumerate(self.shards):
            shard.config = shard_config(layout, index, targets)
        self.reference.config = reference_config(self.reference.config)
        self.monitoring.config = global_config(
            layout, [f"127.0.0.1:{port}" for port in shard_ports], f"127.0.0.1:{self.ports.alertmanager}"
        )
        self.prometheus_url, self.rules_url = self.monitoring.prometheus_url, self.monitoring.rules_url
        self.alertmanager_url = self.monitoring.alertmanager_url
        try:
            for server in (*self.shards, self.reference, self.monitoring):
                server.start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        super().close()
        for server in (*self.shards, self.reference):
            server.close()

    def reference_fired(self, start: float, end: float) -> list[dict[str, str]]:
        """Labels of every alert the single-server reference had firing between `start` and `end`."""
        window = f"{max(1, round(end - start))}s"
        result = self.reference.query(f'ALERTS{{alertstate="firing"}}[{window}]', at=end)
        return [series["metric"] for series in result]

    def reference_active_at(self, alertname: str) -> float | None:
        found = [a for a in self.reference.prometheus_alerts() if a["labels"]["alertname"] == alertname]
        return min((unix_time(a["activeAt"]) for a in found), default=None)

    def diagnose(self) -> str:
        parts = [super().diagnose()]
        for index, shard in enumerate(self.shards):
            targets = shard.api("/api/v1/targets")["activeTargets"]
            parts.append(f"--- shard {index} targets ---\n" + "\n".join(
                f"{t['scrapeUrl']} {t['labels'].get('node')} health={t['health']} error={t['lastError']!r}"
                for t in targets
            ))  # fmt: skip
        alerts = self.reference.prometheus_alerts()
        parts.append(
            "--- reference alerts ---\n" + "\n".join(f"{a['state']} {short_labels(a['labels'])}" for a in alerts)
        )
        return "\n".join(parts)


def _same_alerts(st: FederatedStack, alertname: str) -> list[dict[str, str]]:
    """The `alertname` alerts both servers had firing since the stack started: the same label sets. Either
    server may fire first (each evaluates at its own phase): this waits until the reference has fired too."""

    def reference_fired() -> bool:
        return any(a["alertname"] == alertname for a in st.reference_fired(st.started_at, time.time()))

    st.wait(reference_fired, f"{alertname} firing on the reference server", 60, trainer_alive=False)
    end = time.time()
    on_global = sorted((a for a in st.fired(end=end) if a["alertname"] == alertname), key=str)
    on_one = sorted((a for a in st.reference_fired(st.started_at, end) if a["alertname"] == alertname), key=str)
    assert on_global == on_one, f"global {on_global}\none server {on_one}\n{st.diagnose()}"
    return on_global


def _lag(st: FederatedStack, scenario: str, alert: dict[str, Any]) -> float:
    """How much later the global server's alert became active than the reference's (recorded for the summary)."""
    reference = st.wait(lambda: st.reference_active_at(alert["labels"]["alertname"]), "the reference's alert", 30)
    lag = unix_time(alert["activeAt"]) - reference
    LATENCIES.append(f"federated {scenario}: {alert['labels']['alertname']} active {lag:+.1f}s after one server's")
    assert lag <= LAYER_SLACK_SECONDS, f"the global server's alert lags one server's by {lag:.1f}s"
    return lag


def _global_sees_every_node(st: FederatedStack, name: str) -> None:
    """Wait until the global server holds `name` (a node's part, recorded by its shard) for every node of the run."""
    selector = f'{name}{{run_id="{st.run_id}"}}'
    st.wait(lambda: len(st.query(selector)) == len(NODES), f"{selector} of every node on the global server", 60)


def _split_across_shards(st: FederatedStack) -> None:
    """Each shard scrapes exactly the rank on its node (hashmod by node, as generated)."""
    for index, shard in enumerate(st.shards):

        def ranks(server: MonitoringStack = shard, index: int = index) -> bool:
            return [t["labels"].get("rank") for t in server.api("/api/v1/targets")["activeTargets"]] == [str(index)]

        st.wait(ranks, f"shard {index} to scrape rank {index} only", 60)


def test_a_straggler_is_named_by_the_global_server_as_by_one_server(stack) -> None:
    st: FederatedStack = stack("fed-straggler", kind=FederatedStack)
    st.start_trainer([f"faults.straggler.at_step={STRAGGLE_AT}", "faults.straggler.rank=1",
                      "faults.straggler.seconds=0.5"], max_steps=UNTIL_STOPPED)  # fmt: skip
    # The lag is the layers', not discovery's: the shards find the ranks through rank 0's target file, the
    # reference has them from the start, and a straggler that began before a shard's first scrapes came up to
    # 4 s late on the global server for that alone. The run waits until every layer reads both ranks.
    st.wait_for_step(31)
    with st.paused("every layer reads both ranks before the straggler starts") as step:
        assert step < STRAGGLE_AT, "the run reached the straggler before it paused"
        _split_across_shards(st)
        st.wait(lambda: len(st.query(COMPUTE_RATES)) == NPROC, "both ranks' compute rates on the global server", 60)
    alert = st.wait_for_firing("RankscopeRankImbalance", timeout=120)
    assert (alert["labels"]["rank"], alert["labels"]["node"]) == ("1", NODES[1]), alert["labels"]
    _lag(st, "straggler", alert)
    page = st.pager.wait_for(
        lambda d: any(a["labels"]["alertname"] == "RankscopeRankImbalance" for a in d.body["alerts"]), 30, st.diagnose
    )
    assert [a["labels"]["rank"] for a in page.body["alerts"]] == ["1"]
    assert _same_alerts(st, "RankscopeRankImbalance") == [
        {"__name__": "ALERTS", "alertname": "RankscopeRankImbalance", "alertstate": "firing", "node": NODES[1],
         "rank": "1", "run_id": st.run_id, "severity": "page"}
    ]  # fmt: skip
    # The test's own pause and resume; nothing acts on a straggler.
    assert sorted((a["action"], a["source"]) for a in st.status()["recent"]) == [("pause", "operator"),
                                                                                  ("resume", "operator")]  # fmt: skip
    assert st.stop_trainer() == 0


NAN_AT, NAN_STEPS = 201, 5


def test_a_non_finite_burst_is_acted_on_at_one_step_on_every_rank_through_the_global_server(stack) -> None:
    st: FederatedStack = stack("fed-nonfinite", kind=FederatedStack)
    st.start_trainer(
        [f"faults.nonfinite.at_step={NAN_AT}", f"faults.nonfinite.steps={NAN_STEPS}", "faults.nonfinite.rank=0"],
        max_steps=UNTIL_STOPPED,
    )
    st.wait_for_step(1)  # the control endpoint is up
    with st.paused("until the global server sees the ranks") as step:
        # A burst is over in a second. Rank 0 announces the targets when it starts; the shards find them and record
        # each node's count, then the global server federates those: a burst before that is only ever seen at its
        # final count, no increase.
        assert step < NAN_AT, "the run reached the burst before it paused"
        _global_sees_every_node(st, NONFINITE_NODE_MAX)
    st.wait_for_firing("RankscopeNonFiniteSteps", timeout=120)
    (applied,) = st.wait(lambda: st.settled("reduce_lr"), "the alert's reduce_lr applied on every rank", 30)
    assert (applied["source"], applied["reason"]) == ("alert", "alert:RankscopeNonFiniteSteps"), applied
    assert applied["step"] >= NAN_AT and st.status()["world_size"] == NPROC
    (fired,) = _same_alerts(st, "RankscopeNonFiniteSteps")
    assert (fired["run_id"], fired["action"], fired["severity"]) == (st.run_id, "reduce_lr", "page"), fired
    assert [r["step"] for r in st.settled("reduce_lr")] == [applied["step"]]  # once, both servers firing by now
    assert st.stop_trainer() == 0


def test_a_hung_rank_is_named_with_its_phase_by_the_global_server_as_by_one_server(stack) -> None:
    st: FederatedStack = stack("fed-hang", kind=FederatedStack)
    st.start_trainer(["faults.hang.at_step=31", "faults.hang.rank=1", "faults.hang.kind=compute"],
                     max_steps=UNTIL_STOPPED)  # fmt: skip

    def hung() -> dict[str, Any] | None:
        found = [a for a in st.alerts("RankscopeRankHung") if a["labels"].get("rank") == "1"]
        return found[0] if found else None

    # The restart it asks for ends this job (torchrun --max-restarts 0): the trainer may exit meanwhile.
    alert = st.wait(hung, "RankscopeRankHung for rank 1 on the global server", 120, trainer_alive=False)
    labels = alert["labels"]
    assert (labels["phase"], labels["suspect"], labels["node"], labels["action"]) == (
        "compute", "outside_collective", NODES[1], "restart"
    ), labels  # fmt: skip
    # The federated series kept their own job and instance (honor_labels): the alert names the rank's target.
    assert (labels["job"], labels["instance"]) == ("rankscope", f"127.0.0.1:{st.ports.metrics + 1}"), labels
    _lag(st, "hang", alert)
    _same_alerts(st, "RankscopeRankHung")


HEALTHY_STEPS = 150


def test_a_healthy_run_fires_nothing_on_either_server_and_few_series_per_rank_cross(stack) -> None:
    st: FederatedStack = stack("fed-healthy", kind=FederatedStack)
    job = st.start_trainer(max_steps=HEALTHY_STEPS)
    _split_across_shards(st)
    assert job.wait_exit(timeout=300) == 0, job.tail()
    end = time.time()
    assert st.fired(end=end) == [] and st.reference_fired(st.started_at, end) == []
    assert st.pages() == []
    # What crossed to the global server per rank. Rank 1 carries no job-wide series (rank 0 keeps the goodput
    # ledger once per job); it is its node's local rank 0, so it also carries the series the rules read from one
    # rank per node, and its node's parts of the run's figures (run_node:*, labelled by node, not by rank):
    # at RANKS_PER_NODE ranks per node each rank's share of both is that fraction of them.
    per_node = "|".join(sorted({s.name for s in split(Tunables()).federated if 'local_rank="0"' in s.matchers}))
    every = _count_by("rank", st, f'{{run_id="{st.run_id}", rank!="", __name__!~"{per_node}"}}')
    one_per_node = _count_by("rank", st, f'{{run_id="{st.run_id}", rank!="", __name__=~"{per_node}"}}')
    node_parts = _count_by("node", st, f'{{run_id="{st.run_id}", rank="", node!=""}}')
    at_scale = every["1"] + (one_per_node["1"] + node_parts[NODES[1]]) / RANKS_PER_NODE
    figures = f"{every} + one per node {one_per_node} + node parts {node_parts}"
    LATENCIES.append(f"federated healthy: series per rank on the global server {at_scale:.1f}: {figures}")
    assert at_scale <= FEDERATED_SERIES_PER_RANK, f"{at_scale:.1f} series per rank on the global server: {figures}"


def _count_by(label: str, st: FederatedStack, selector: str) -> dict[str, int]:
    return {s["metric"][label]: int(s["value"][1]) for s in st.query(f"count by ({label}) ({selector})")}
