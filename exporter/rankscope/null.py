"""A do-nothing Monitor for when monitoring is off: the loop code stays the same."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["NullMonitor"]


class _NullStep:
    skipped = False

    def __init__(self, index: int) -> None:
        self.index = index

    def record(self, loss: Any = None, grad_norm: Any = None) -> bool:
        return True


class NullMonitor:
    """Same methods as Monitor; records nothing, serves nothing, costs nothing."""

    port = None

    def __init__(self) -> None:
        self.global_step = 0

    def start(self) -> None:
        return None

    def finish(self) -> None:
        return None

    def close(self) -> None:
        return None

    def watch(self, model: Any, optimizer: Any = None, scaler: Any = None) -> None:
        return None

    def attach_comm_hook(self, ddp_model: Any) -> None:
        return None

    def watch_mesh(self, mesh: Any) -> None:
        return None

    def collective_in_flight(self) -> dict[str, Any] | None:
        return None  # no collective view: stacks are handed over without one

    def data(self, iterable: Iterable[Any]) -> Iterator[Any]:
        return iter(iterable)

    def record_data_wait(self, seconds: float) -> None:
        return None

    @contextmanager
    def step(self, samples: int = 0, tokens: int = 0, max_seq_len: Any = None) -> Iterator[_NullStep]:
        self.global_step += 1
        yield _NullStep(self.global_step)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: Any = None) -> Any:  # fmt: skip
        import torch  # here: the null monitor is importable without torch until it is needed

        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)

    def set_step(self, step: int) -> None:
        self.global_step = step

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def record_loss(self, value: Any, split: str = "val") -> None:
        return None

    def set(self, name: str, value: Any, **labels: str) -> None:
        return None

    def set_each(self, name: str, values: Any, label: str, keys: Any, **labels: str) -> None:
        return None

    def inc(self, name: str, amount: Any = 1, **labels: str) -> None:
        return None

    def observe(self, name: str, value: Any, **labels: str) -> None:
        return None

    def flush(self) -> None:
        return None

    def record_error(self, probe: str) -> None:
        return None
