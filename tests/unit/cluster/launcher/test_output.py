"""Prefixed output: whole lines, the task's name in front, stdout and stderr kept apart."""

from __future__ import annotations

import io
import os

from phalanx.cluster._output import PrefixedOutput


def _pump(output, name, data, stderr):
    read, write = os.pipe()
    os.write(write, data)
    os.close(write)
    output.pump(name, os.fdopen(read, "rb"), stderr).join(timeout=5)


def test_lines_are_prefixed_and_a_last_partial_line_is_ended():
    out = io.StringIO()
    _pump(PrefixedOutput(out), "worker-1", b"one\ntwo\nno newline", stderr=False)
    assert out.getvalue() == "[worker-1] one\n[worker-1] two\n[worker-1] no newline\n"


def test_undecodable_bytes_do_not_stop_the_stream():
    out = io.StringIO()
    _pump(PrefixedOutput(out), "ps-0", b"\xff bad\nok\n", stderr=True)
    assert out.getvalue() == "[ps-0] \ufffd bad\n[ps-0] ok\n"


def test_stdout_and_stderr_go_to_ours_without_an_out_stream(capsys):
    output = PrefixedOutput()
    _pump(output, "chief-0", b"to stdout\n", stderr=False)
    _pump(output, "chief-0", b"to stderr\n", stderr=True)
    output.note("a note")
    captured = capsys.readouterr()
    assert captured.out == "[chief-0] to stdout\n"
    assert captured.err == "[chief-0] to stderr\n[phalanx launch] a note\n"


def test_a_closed_stream_does_not_stop_the_draining():
    out = io.StringIO()
    out.close()
    read, write = os.pipe()
    thread = PrefixedOutput(out).pump("worker-0", os.fdopen(read, "rb"), stderr=False)
    os.write(write, b"x" * 100 + b"\n")  # more lines than a failing writer could survive
    os.write(write, b"y\n" * 10_000)
    os.close(write)
    thread.join(timeout=5)
    assert not thread.is_alive()
