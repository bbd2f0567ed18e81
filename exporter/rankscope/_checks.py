"""One way to check a setting's range, with one wording of the error, for every config of the project
(rankscope.config, rankscope.control.config, rankscope_trainer.config, rankscope.mixin.config)."""

from __future__ import annotations

__all__ = ["check_range"]


def _bounds(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    low = f"[{ge}" if ge is not None else f"({gt}" if gt is not None else None
    high = f"{le}]" if le is not None else f"{lt})" if lt is not None else None
    if low and high:
        if low[0] == "[" and high[-1] == "]":
            return f"between {ge} and {le}"
        if low[0] == "(" and high[-1] == ")":
            return f"between {gt} and {lt} (exclusive)"
        return f"in {low}, {high}"
    if low:
        return f">= {ge}" if ge is not None else f"> {gt}"
    if high:
        return f"<= {le}" if le is not None else f"< {lt}"
    raise TypeError("check_range needs at least one bound")


def check_range(
    name: str,
    value: object,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    integer: bool = False,
    note: str = "",
    error: type[Exception] = ValueError,
) -> None:
    """Raise `error` ("NAME must be >= 1, got 0") unless `value` is a number (an int with `integer`; never a
    bool) within every bound given: `ge`/`gt` below, `le`/`lt` above. NaN is out of every range. `note`
    follows the range in the message ("between 0 and 3600 (0: no cache)")."""
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool)
    if ok:
        number = float(value)  # type: ignore[arg-type]
        ok = (
            (ge is None or number >= ge)
            and (gt is None or number > gt)
            and (le is None or number <= le)
            and (lt is None or number < lt)
        )  # comparisons with NaN are all false
    if not ok:
        what = ("an integer " if integer else "") + _bounds(ge, gt, le, lt)
        raise error(f"{name} must be {what}{note}, got {value!r}")
