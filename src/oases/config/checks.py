"""The value checks every config section runs: a one-line ``ValueError`` naming the key and its
numbers (``load_config`` turns it into a ``ConfigError``)."""

from collections.abc import Iterable


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _positive(section: str, obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(value > 0, f"{section}.{name}={value} must be > 0")


def _divisible(a_name: str, a: int, b_name: str, b: int) -> None:
    _check(a % b == 0, f"{a_name}={a} is not divisible by {b_name}={b}")


def check_sequence_split(seq_len: int, degrees: Iterable[int]) -> None:
    """Sequence parallelism slices the sequence over each TP group: every degree must divide
    ``model.seq_len``. The one wording of this error, from the command line and a plan file."""
    for d in sorted(set(degrees)):
        _check(
            seq_len % d == 0,
            f"sequence parallelism: model.seq_len={seq_len} is not divisible by tp={d}",
        )
