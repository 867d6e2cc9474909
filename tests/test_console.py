"""Rank 0's console: plain step lines in logs and pipes, a tqdm bar on a terminal with messages
printed above it, nothing from the other ranks."""

import io

from oases.train.console import Console


def _run(console, first=0, end=10, steps=10, log_every=4):
    console.start(first, end, steps, log_every, tokens_per_step=1000)
    for step in range(first + 1, end + 1):
        console.step(step, 2.0 + step / 100, 1e-3, 0.5, 0.01)
        if step == 5:
            console.say("step     5/10  validation loss 2.0000")
    console.close()
    console.say("done")


def test_plain_lines_every_log_every_and_the_first_and_last_step():
    out = io.StringIO()
    console = Console(True, out)
    assert not console.tty
    _run(console)
    lines = out.getvalue().splitlines()
    steps = [
        int(line.split()[1].split("/")[0])
        for line in lines
        if "loss 2." in line and "validation" not in line
    ]
    assert steps == [1, 4, 8, 10]
    assert "\r" not in out.getvalue()
    # the step's own loss (as metrics.jsonl), then the mean over the steps since the previous
    # line, named: steps 5..8 -> 2.065
    line8 = next(line for line in lines if line.startswith("step     8/10"))
    assert "loss 2.0800  mean 2.0650 over steps 5-8" in line8 and "100,000 tok/s" in line8
    line1 = next(line for line in lines if line.startswith("step     1/10"))
    assert "loss 2.0100  lr" in line1  # one step: no mean
    assert lines[-1] == "done" and "step     5/10  validation loss 2.0000" in lines


def test_resumed_run_counts_from_its_step():
    out = io.StringIO()
    _run(Console(True, out), first=6, end=10, log_every=4)
    steps = [line.split()[1] for line in out.getvalue().splitlines() if "tok/s" in line]
    assert steps == ["7/10", "8/10", "10/10"]


def test_terminal_bar_with_messages_above_it():
    out = io.StringIO()
    console = Console(True, out, tty=True)  # a terminal with a size: see the last test
    _run(console)
    text = out.getvalue()
    # the message is a line of its own, after the bar was cleared; the bar is drawn again below
    before, sep, after = text.partition("\rstep     5/10  validation loss 2.0000\n")
    assert sep and before.endswith(" ") and after.startswith("\rstep 5/10 |")
    assert "50%, loss 2.050 | 100k tok/s" in after.split("\r")[1]
    final = text.split("\r")[-1]
    assert final.startswith("step 10/10 |") and "100%, loss 2.100 | 100k tok/s" in final
    assert text.endswith("\ndone\n")  # after close(), plain lines again
    assert "step     1/10" not in text  # no plain step lines on a terminal


def test_other_ranks_print_nothing():
    out = io.StringIO()
    _run(Console(False, out, tty=True))
    assert out.getvalue() == ""


def test_a_bar_only_on_a_terminal_with_a_size():
    import fcntl
    import os
    import struct
    import termios

    from oases.train.console import terminal_has_room

    assert not terminal_has_room(io.StringIO())
    leader, follower = os.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            for rows, cols, expected in ((0, 0, False), (24, 80, True)):
                fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
                # 0 x 0 (a recorder, some containers): tqdm would hide its bar, so plain lines
                assert terminal_has_room(tty) is expected
                assert Console(True, tty).tty is expected
    finally:
        os.close(leader)
        os.close(follower)
