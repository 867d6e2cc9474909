"""The rank-0 progress line: formatting, time left, non-TTY throttling, TTY rewriting."""

import io

import pytest

from oases.train.progress import Progress, format_duration, format_rate


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class TTYStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_formatting_helpers():
    assert format_duration(32.4) == "0:32"
    assert format_duration(725) == "12:05"
    assert format_duration(3723) == "1:02:03"
    assert format_duration(float("nan")) == "-:--"
    assert format_rate(950) == "950"
    assert format_rate(5123) == "5.1k"
    assert format_rate(12_345_678) == "12.3M"


def test_line_and_time_left_from_recent_steps():
    clock, out = FakeClock(), io.StringIO()
    p = Progress(200, out, clock=clock, width=12, window=10, every_steps=1000, every_s=1e9)
    assert not p.tty
    for step in range(1, 121):
        clock.t += 10.0 if step <= 100 else 0.4  # the recent steps are fast
        p.update(step, 2.5123, 5100.0)
    line = p.render(120, 2.5123, 5100.0)
    # 80 steps left at the mean of the last 10 steps (0.4 s) -> 32 s
    assert line == "step 120/200 [=======>    ] 60% loss 2.512 | 5.1k tok/s | 0:32 left"
    assert p.render(200, 1.0, 10).startswith("step 200/200 [============] 100% loss 1.000")
    assert p.render(0, 9.0, 0).startswith("step 0/200 [>           ] 0% ")


def test_first_update_estimates_from_the_start():
    clock = FakeClock()
    p = Progress(11, io.StringIO(), clock=clock)
    clock.t += 3.0
    p.update(1, 4.0, 100)
    assert p.seconds_per_step() == pytest.approx(3.0)
    assert p.render(1, 4.0, 100).endswith("| 0:30 left")


def test_non_tty_prints_plain_lines_every_n_steps_or_seconds():
    clock, out = FakeClock(), io.StringIO()
    p = Progress(100, out, clock=clock, every_steps=10, every_s=10.0)
    for step in range(1, 36):
        clock.t += 0.1
        p.update(step, 3.0, 1000)
    clock.t += 12.0  # a slow step: printed because 10 s passed
    p.update(36, 3.0, 1000)
    clock.t += 0.1
    p.update(37, 3.0, 1000)
    p.close()
    p.update(38, 3.0, 1000)  # after close: ignored
    text = out.getvalue()
    assert "\r" not in text
    steps = [int(line.split()[1].split("/")[0]) for line in text.splitlines()]
    assert steps == [1, 11, 21, 31, 36, 37]  # first, every 10, the 10 s one, the last at close
    p.close()  # idempotent
    assert out.getvalue() == text


def test_non_tty_prints_the_last_step():
    out = io.StringIO()
    clock = FakeClock()
    p = Progress(3, out, clock=clock, every_steps=100)
    for step in (1, 2, 3):
        p.update(step, 1.0, 1)
    p.close()
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["1/3", "3/3"]


def test_tty_rewrites_the_line_in_place():
    clock, out = FakeClock(), TTYStream()
    p = Progress(20, out, clock=clock, width=10)
    assert p.tty
    for step in range(1, 4):
        clock.t += 1.0
        p.update(step, 1.0, 10_000_000 if step == 1 else 5)  # step 1 has the longest line
    text = out.getvalue()
    assert text.count("\r") == 3 and "\n" not in text
    frames = text.split("\r")[1:]
    assert frames[0].startswith("step 1/20")
    assert len(frames[1]) == len(frames[0])  # a shorter line is padded over the longer one
    p.message("val loss 1.234")
    p.close()
    text = out.getvalue()
    assert "\rval loss 1.234\n" in text
    assert text.endswith("\n") and text.rstrip("\n").rsplit("\r", 1)[1].startswith("step 3/20")
    assert text.count("\n") == 2  # the message and the final newline


def test_disabled_writes_nothing():
    out = TTYStream()
    p = Progress(5, out, enabled=False)
    p.update(1, 1.0, 1)
    p.message("x")
    p.close()
    assert out.getvalue() == ""
    with pytest.raises(ValueError, match="total_steps=0"):
        Progress(0, out)
