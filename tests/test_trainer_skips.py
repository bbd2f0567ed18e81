"""rankscope_trainer.skips: the records of the data windows rollbacks skipped, and the file beside the checkpoints."""

from __future__ import annotations

import pytest
from rankscope_trainer.skips import SkipRecord, merge_skips, read_skip_file, skip_file, write_skip_file


def test_records_round_trip_through_the_file_of_their_lineage(tmp_path) -> None:
    records = [SkipRecord(40, 1, 128, 26, 0.5, 41, 51, "alert:RankscopeLossDiverging", lookahead=4)]
    write_skip_file(tmp_path, "4d278816", records)
    assert read_skip_file(tmp_path, "4d278816") == records
    assert read_skip_file(tmp_path, "00000000") == []  # another lineage: no file, no records
    assert [p.name for p in tmp_path.iterdir()] == ["skips-4d278816.json"]  # no temporary file left


def test_a_later_rollback_to_the_same_checkpoint_replaces_the_earlier_record() -> None:
    first, other = SkipRecord(40, 1, 128, 26), SkipRecord(80, 2, 64, 10)
    second = SkipRecord(40, 1, 128, 60, reason="operator:again")
    assert merge_skips([first, other], [second]) == [other, second]


@pytest.mark.parametrize("content", ["[{", '{"not": "a list"}', '[{"epoch": 1}]', "\x00\x01"])
def test_a_damaged_record_file_is_one_line_naming_it(tmp_path, content) -> None:
    skip_file(tmp_path, "4d278816").write_text(content)
    with pytest.raises(ValueError) as caught:
        read_skip_file(tmp_path, "4d278816")
    message = str(caught.value)
    assert message.startswith(f"rollback record {skip_file(tmp_path, '4d278816')} is unreadable (")
    assert "\n" not in message
