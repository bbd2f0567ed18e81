import json

import pytest
from rankscope import Monitor, MonitorConfig, RankIdentity, write_file_sd


def test_a_single_process_writes_its_own_target_with_identity_labels(tmp_path):
    identity = RankIdentity(run_id="r1", rank=0, local_rank=0, world_size=1, node="n0")
    monitor = Monitor(MonitorConfig(host="127.0.0.1", base_port=0), identity, device="cpu")
    monitor.start()
    try:
        write_file_sd(monitor, tmp_path / "sd" / "targets.json")
        groups = json.loads((tmp_path / "sd" / "targets.json").read_text())
        assert groups == [{"targets": [f"127.0.0.1:{monitor.port}"], "labels": identity.labels()}]
        assert [p.name for p in (tmp_path / "sd").iterdir()] == ["targets.json"]  # no temp files left
    finally:
        monitor.close()


def test_writing_targets_before_start_is_a_clear_error(tmp_path):
    monitor = Monitor(MonitorConfig(base_port=0), RankIdentity.from_env({}, node="n"), device="cpu")
    with pytest.raises(RuntimeError, match="needs a started monitor"):
        write_file_sd(monitor, tmp_path / "t.json")
