"""ActionQueue and RunSnapshot: what the HTTP thread and the training thread share."""

from __future__ import annotations

import threading

import pytest
from rankscope.control.actions import ActionRequest, RequestError
from rankscope.control.state import ActionQueue, RunSnapshot


def operator(action="checkpoint"):
    return ActionRequest(action, "operator", "operator:test")


def from_alert(key, action="reduce_lr"):
    return ActionRequest(action, "alert", "alert:LossPlateau", key=key)


def test_submitted_requests_are_pending_until_settled():
    queue = ActionQueue(clock=lambda: 100.0)
    (answer,) = queue.submit([operator()])
    assert not answer.duplicate
    assert [r["id"] for r in queue.snapshot()["pending"]] == [answer.id]
    (record,) = queue.take()
    assert [r["id"] for r in queue.snapshot()["pending"]] == [answer.id]  # taken, still being applied
    assert queue.take() == []
    queue.settle(record, "applied", step=7)
    assert queue.snapshot()["pending"] == []
    (recent,) = queue.snapshot()["recent"]
    assert (recent["id"], recent["status"], recent["step"], recent["settled_at"]) == (answer.id, "applied", 7, 100.0)


def test_the_same_alert_delivered_again_is_a_duplicate_with_the_first_id():
    queue = ActionQueue()
    (first,) = queue.submit([from_alert("f@t")])
    (again,) = queue.submit([from_alert("f@t")])
    assert again.duplicate and again.id == first.id
    assert len(queue.take()) == 1


def test_a_repeat_inside_one_payload_is_a_duplicate_too():
    queue = ActionQueue()
    first, second, other = queue.submit([from_alert("f@t"), from_alert("f@t"), from_alert("g@t")])
    assert (first.duplicate, second.duplicate, other.duplicate) == (False, True, False)
    assert second.id == first.id
    assert len(queue.take()) == 2


def test_a_new_episode_of_the_same_alert_acts_again():
    queue = ActionQueue()
    queue.submit([from_alert("f@2026-01-01T00:00:00Z")])
    (later,) = queue.submit([from_alert("f@2026-01-01T01:00:00Z")])
    assert not later.duplicate


def test_a_full_queue_answers_503_and_queues_nothing():
    queue = ActionQueue(max_pending=2)
    queue.submit([operator()])
    with pytest.raises(RequestError) as caught:
        queue.submit([operator(), operator()])
    assert caught.value.status == 503
    assert len(queue.snapshot()["pending"]) == 1


def test_after_a_stop_only_duplicates_are_accepted():
    queue = ActionQueue()
    queue.submit([from_alert("stop@t", action="stop")])
    assert queue.stopping
    with pytest.raises(RequestError) as caught:
        queue.submit([operator("checkpoint")])
    assert caught.value.status == 409
    # Alertmanager repeating the stop alert must not get a final error for it.
    (again,) = queue.submit([from_alert("stop@t", action="stop")])
    assert again.duplicate


def test_a_refused_batch_remembers_no_alert_keys():
    queue = ActionQueue(max_pending=1)
    with pytest.raises(RequestError):
        queue.submit([from_alert("a@t"), from_alert("b@t")])
    (answer,) = queue.submit([from_alert("a@t")])
    assert not answer.duplicate


def test_recent_actions_are_bounded():
    queue = ActionQueue(recent=3)
    queue.submit([operator() for _ in range(5)])
    for record in queue.take():
        queue.settle(record, "applied", step=1)
    assert len(queue.snapshot()["recent"]) == 3


def test_a_waiting_loop_wakes_when_a_request_arrives():
    queue = ActionQueue()
    woke = threading.Event()

    def wait() -> None:
        if queue.wait_for_pending(timeout=30):
            woke.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    queue.submit([operator()])
    waiter.join(timeout=30)
    assert woke.is_set()


def test_waiting_with_nothing_pending_times_out_false():
    assert ActionQueue().wait_for_pending(timeout=0.01) is False


def test_the_snapshot_hands_out_copies():
    snapshot = RunSnapshot()
    rates = [0.1]
    snapshot.update(step=3, learning_rates=rates)
    rates.append(99.0)
    read = snapshot.read()
    assert read["learning_rates"] == [0.1]
    read["learning_rates"].append(5.0)
    assert snapshot.read()["learning_rates"] == [0.1]


def test_the_snapshot_refuses_unknown_fields():
    with pytest.raises(AttributeError, match="no field 'stepp'"):
        RunSnapshot().update(stepp=1)
