import torch
from rankscope.deferred import DeferredValues


def test_cpu_tensors_and_numbers_resolve_immediately():
    seen = []
    deferred = DeferredValues()
    deferred.add(torch.tensor([1.0, 2.0]), seen.append)
    deferred.add(3, seen.append)
    assert seen == [[1.0, 2.0], [3.0]] and len(deferred) == 0


def test_flush_keeps_order_and_splits_values_back_per_item():
    seen = []
    deferred = DeferredValues()
    deferred._items.append((torch.tensor([1.0, 2.0]), lambda v: seen.append(("a", v))))  # as if on a device
    deferred._tensors += 1  # as add() counts a queued device tensor
    deferred.add(torch.tensor(3.0), lambda v: seen.append(("b", v)))  # queued behind, keeps order
    assert seen == []
    deferred.flush()
    assert seen == [("a", [1.0, 2.0]), ("b", [3.0])]
