"""A native crash or an exit in the code under test is an error of the case it killed, the other
cases run, and the report is still written (issue 33, Note [Crash isolation] in
contracts/isolation.py); the user's Ctrl-C stops the run with what is done.

The author package (tests/crash_pipelines.py) is written into a temporary folder; the console
script runs it in a subprocess, and each child process that starts costs about 1.5 s (more on a
loaded machine).  The supervisor's bookkeeping (restarts, bounds, a crash outside a case) is
tested with a fake child that imports no torch.
"""

from __future__ import annotations

import io

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from crash_pipelines import (BITWISE, OP_LINE, REPEATABLE, TIMEOUT_S, cli, env, results,
                             write_author)
from offload_ref.contracts import isolation

@pytest.fixture(scope="module")
def author(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_author(tmp_path_factory.mktemp("crashy"))


# -- a native crash, an exit: an error of the case, the others run, the report is written -----


#: the tests reading the one run of ``crashed`` (about 10 s: three children), on one xdist worker
_ONE_RUN = pytest.mark.xdist_group("crash_isolation_crashed")


@pytest.fixture(scope="module")
def crashed(author: Path) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    proc = cli(["crashy.pipes:CRASHING", "--check", BITWISE, "--check", REPEATABLE,
                "--json", "crashed.json"], author)
    assert (author / "crashed.json").exists(), proc.stdout + proc.stderr
    return proc, results(author / "crashed.json")


@_ONE_RUN
def test_a_segfault_in_one_case_is_an_error_naming_the_signal_and_the_python_frames(
        crashed: tuple[subprocess.CompletedProcess, dict[str, dict]]) -> None:
    proc, results = crashed
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    crash = results[f"{BITWISE}-segv-model_level"]
    assert crash["outcome"] == "error", crash
    lines = crash["message"].splitlines()
    assert lines[0] == ("the process running this case died from signal 11 (SIGSEGV); the op "
                        "is unknown"), lines
    frames = lines[lines.index("Python frames at the crash, most recent call first:") + 1:]
    assert "crashy/pipes.py" in frames[0] and frames[0].endswith(" in end"), frames
    assert any(line.endswith(" in forward") for line in frames), frames
    # the text report shows it as an error, with its reproduction line
    assert f"ERROR {BITWISE}-segv-model_level" in proc.stdout, out
    assert "died from signal 11 (SIGSEGV)" in proc.stdout, out
    assert (f"reproduce: offload-ref check crashy.pipes:CRASHING --name segv --check {BITWISE} "
            f"--strategy model_level") in proc.stdout, out


@_ONE_RUN
def test_the_simulated_accelerators_crash_line_names_the_op(
        crashed: tuple[subprocess.CompletedProcess, dict[str, dict]]) -> None:
    _, results = crashed
    crash = results[f"{BITWISE}-op_crash-model_level"]
    assert crash["outcome"] == "error", crash
    first, second = crash["message"].splitlines()[:2]
    assert first == ("the process running this case died from signal 11 (SIGSEGV) in "
                     "aten::fake_op.Tensor on hpu"), first
    assert OP_LINE in second and "--single-device" in second, second
    assert "torch's aten::fake_op.Tensor" in second and "a defect of offload-ref" in second


@_ONE_RUN
def test_the_cases_before_and_after_a_crash_all_have_their_results(
        crashed: tuple[subprocess.CompletedProcess, dict[str, dict]]) -> None:
    proc, results = crashed
    expected = {f"{BITWISE}-{name}-model_level": "error" for name in ("segv", "op_crash")}
    expected[f"{BITWISE}-nothing-model_level"] = "passed"
    expected.update({f"{REPEATABLE}-{name}-model_level": "passed"
                     for name in ("segv", "op_crash", "nothing")})
    assert {case: r["outcome"] for case, r in results.items()} == expected
    # progress kept flowing, to the last case
    assert "offload-ref check: 6 cases over 3 pipeline(s)" in proc.stderr, proc.stderr
    assert "[6/6] 100%  2 failed" in proc.stderr, proc.stderr


def test_without_the_supervisor_a_crash_leaves_no_report(author: Path) -> None:
    """The broken implementation: the same cases in the command's own process."""
    code = ("import sys; from offload_ref.cli import main; sys.exit(main(sys.argv[1:], "
            "isolate=False))")
    proc = subprocess.run(
        [sys.executable, "-c", code, "check", "crashy.pipes:CRASHING", "--name", "segv",
         "--check", BITWISE, "--json", "in_process.json"],
        check=False, cwd=author, env=env(author), capture_output=True, text=True,
        timeout=TIMEOUT_S)
    assert proc.returncode == -signal.SIGSEGV, proc.stdout + proc.stderr
    assert not (author / "in_process.json").exists()


# -- the user's Ctrl-C -------------------------------------------------------------------------


def test_ctrl_c_stops_the_run_writes_what_is_done_and_exits_130(author: Path) -> None:
    """SIGINT to both processes, as a terminal sends it (the command forwarding it to its child
    when only the command got it: test_a_ctrl_c_the_child_did_not_get_is_forwarded_then_killed).
    """
    ready = author / "ready"
    environment = {**env(author), "CRASHY_READY": str(ready)}
    script = Path(sys.executable).with_name("offload-ref")
    proc = subprocess.Popen([str(script), "check", "crashy.pipes:SLEEP", "--check", BITWISE,
                             "--json", "sleep.json"], cwd=author, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), proc.communicate()
        pressed = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        stopped = time.monotonic() - pressed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out + err
    assert stopped < 8, stopped
    assert (f"offload-ref check: interrupted (Ctrl-C) during {BITWISE}-sleep-layer_wise; the "
            f"report shows the 1 result(s) that came before") in err, err
    report = json.loads((author / "sleep.json").read_text())
    assert [(r["strategy"], r["outcome"]) for r in report["results"]] == [
        ("model_level", "passed")], report["results"]
    assert report["interrupted"].startswith("interrupted (Ctrl-C) during"), report
    assert "1 passed, 0 failed" in out, out


# -- reading what a child left ------------------------------------------------------------------


def test_a_crash_line_naming_no_op_does_not_claim_one() -> None:
    line = ("offload-ref simulated accelerator: fatal signal 11 (SIGSEGV) while running no hpu "
            "op (the signal came from outside the simulated accelerator's ops)")
    faults = ('Fatal Python error: Segmentation fault\n\nThread 0x01 (most recent call first):\n'
              '  File "/x/other.py", line 3 in wait\n\n'
              'Current thread 0x02 (most recent call first):\n'
              '  File "/x/pipe.py", line 7 in forward\n  File "/x/kit.py", line 9 in run\n\n'
              'Extension modules: torch (total: 1)\n')
    how, detail = isolation.crash_report(-11, line + "\n", faults)
    assert how == "died from signal 11 (SIGSEGV); the op is unknown", how
    assert detail[0].startswith(f"the simulated accelerator's crash line: {line!r}: the crash "
                                f"was not inside one of its ops"), detail
    assert detail[1:] == ["Python frames at the crash, most recent call first:",
                          '  File "/x/pipe.py", line 7 in forward',
                          '  File "/x/kit.py", line 9 in run'], detail
    # an op that is not torch's: its own kernel crashed, not the simulated device
    line = ("offload-ref simulated accelerator: fatal signal 11 (SIGSEGV) while running "
            "my_ext::fused_rope on hpu")
    how, detail = isolation.crash_report(-11, line + "\n", "")
    assert how == "died from signal 11 (SIGSEGV) in my_ext::fused_rope on hpu", how
    assert detail == [
        f"my_ext::fused_rope is not one of torch's ops (its crash line: {line!r}): its own kernel "
        f"crashed while the simulated accelerator ran it on hpu tensors; rerun with "
        f"--single-device to see whether it crashes on the CPU too, and look at the frames "
        f"below"], detail
    # a killed process: no frames, and where SIGKILL comes from
    how, detail = isolation.crash_report(-9, "", "")
    assert how == "died from signal 9 (SIGKILL); the op is unknown"
    assert detail == ["SIGKILL comes from outside the process: the system's out-of-memory killer "
                      "(look at the pipeline's memory), or a user"], detail


# -- the supervisor's bookkeeping, with a fake child (no torch: milliseconds per child) ---------

_FAKE_CHILD = textwrap.dedent("""
    import json, os, signal, sys, time

    config = json.load(open(sys.argv[1]))
    mode, specs = os.environ["FAKE_MODE"], os.environ["FAKE_SPECS"].split(",")
    journal = open(config["journal"], "a")

    def write(kind, **fields):
        journal.write(json.dumps({"kind": kind, **fields}) + "\\n")
        journal.flush()

    if mode == "startup":
        os.kill(os.getpid(), signal.SIGSEGV)
    write("device", line="a fake device")
    only = [s for s in specs if s in config["only"]]
    if mode == "preflight" and "a" in only:
        write("phase", what="preflight", spec="a", strategy=None, check=None)
        os.kill(os.getpid(), signal.SIGSEGV)
    plan = [{"check": f"check_{i}", "spec": s, "strategy": "model_level", "source": None,
             "offloader": None} for i in range(int(os.environ.get("FAKE_CHECKS", "4")))
            for s in only]
    todo = [c for c in plan if f"{c['check']}-{c['spec']}-model_level" not in config["skip"]]
    write("planned", ids=todo)
    for case in todo:
        write("started", id=case)
        if case["spec"] == "a" or mode == "crash_all":
            if mode in ("crash_a", "crash_all"):
                os.kill(os.getpid(), signal.SIGSEGV)
            if mode == "exit_a":
                os._exit(0)
            if mode == "escape_a":
                write("escaped", text="Traceback (most recent call last):\\nSystemExit: 5")
                sys.exit(70)
        write("result", result={"id": case, "outcome": "passed", "message": "", "seconds": 0.0})
    write("done")
""")


@pytest.fixture
def fake_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "fake_child.py"
    path.write_text(_FAKE_CHILD)

    def run(mode: str, specs: str = "a,b", **env: str) -> isolation.Supervised:
        monkeypatch.setenv("FAKE_MODE", mode)
        monkeypatch.setenv("FAKE_SPECS", specs)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        seen: list[tuple[int, int, str]] = []
        run = isolation.supervise([sys.executable, "-S", str(path)], ["check"],
                                  spec_names=specs.split(","), include_global=False,
                                  progress=lambda done, total, r: seen.append(
                                      (done, total, str(r.id))))
        assert [done for done, _, _ in seen] == list(range(1, len(run.results) + 1)), seen
        return run

    return run


def _outcomes(run: isolation.Supervised) -> list[tuple[str, str]]:
    return [(str(r.id), r.outcome) for r in run.results]


def test_a_spec_that_keeps_crashing_has_its_remaining_cases_not_run(fake_child) -> None:
    run = fake_child("crash_a")
    assert _outcomes(run) == [
        ("check_0-a-model_level", "error"), ("check_0-b-model_level", "passed"),
        ("check_1-a-model_level", "error"), ("check_1-b-model_level", "passed"),
        ("check_2-a-model_level", "error"), ("check_2-b-model_level", "passed"),
        ("check_3-b-model_level", "passed"), ("check_3-a-model_level", "error")]
    assert run.children == 4 and run.device == "a fake device" and run.interrupted is None
    messages = [r.message.splitlines() for r in run.results if r.outcome == "error"]
    assert [m[0] for m in messages[:3]] == [
        "the process running this case died from signal 11 (SIGSEGV); the op is unknown"] * 3
    assert [m[-1] for m in messages[:3]] == [
        "the kit ran the other cases in a new process"] * 2 + [
        "3 cases of a crashed the process: its remaining cases were not run"]
    # the case not run has a result (before, it vanished: '-' in the matrix, not in the totals)
    assert messages[3] == [
        "not run: 3 cases of a crashed the process (check_0-a-model_level, "
        "check_1-a-model_level, check_2-a-model_level), so the kit ran no more of its cases; "
        "rerun this one with the reproduce line, or fix the crash and rerun them all"]


def test_cases_not_run_after_crashes_are_in_the_matrix_the_totals_and_the_text(
        fake_child) -> None:
    from offload_ref.contracts import report

    run = fake_child("crash_a", FAKE_CHECKS="6")
    rows = report.rows_from_results(run.results)
    assert report.summary(rows)["total"] == 12 and report.summary(rows)["error"] == 6
    out = io.StringIO()
    report.render(rows, out=out)
    text = out.getvalue()
    assert "not run: 3 cases of a crashed the process (check_0-a-model_level, " in text, text
    assert "the same error in 2 more case(s): check_4-a-model_level, check_5-a-model_level" in \
        text, text
    assert "6 passed, 6 failed (6 with an error) (12 cases)" in text, text


def test_an_exit_from_the_code_under_test_is_an_error_of_its_case(fake_child) -> None:
    run = fake_child("exit_a", FAKE_CHECKS="1")
    assert _outcomes(run) == [("check_0-a-model_level", "error"),
                              ("check_0-b-model_level", "passed")]
    assert run.results[0].message.splitlines()[:2] == [
        "the process running this case exited with status 0 before it reported a result",
        "the code under test ended the process itself (os._exit, or native code calling exit()); "
        "the Python frames are unknown"]


def test_an_exception_the_child_did_not_catch_is_charged_to_its_case(fake_child) -> None:
    run = fake_child("escape_a", FAKE_CHECKS="1")
    assert _outcomes(run) == [("check_0-a-model_level", "error"),
                              ("check_0-b-model_level", "passed")]
    assert run.results[0].message.splitlines()[:4] == [
        "the process running this case stopped on an exception the kit did not catch (exit "
        "status 70)", "the exception:", "  Traceback (most recent call last):",
        "  SystemExit: 5"]


def test_a_crash_in_a_preflight_is_that_specs_error_and_the_others_run(fake_child) -> None:
    run = fake_child("preflight", FAKE_CHECKS="2")
    assert _outcomes(run) == [("preflight-a", "error"), ("check_0-b-model_level", "passed"),
                              ("check_1-b-model_level", "passed")]
    lines = run.results[0].message.splitlines()
    assert lines[0] == ("the process running the preflight of a died from signal 11 (SIGSEGV); "
                        "the op is unknown"), lines
    assert lines[-1] == "the checks of a were not run", lines


def test_a_child_dying_before_any_case_is_one_error_and_no_retry(fake_child) -> None:
    run = fake_child("startup")
    assert _outcomes(run) == [("preflight", "error")] and run.children == 1
    assert run.device is None
    assert run.results[0].message.startswith(
        "the process running the checks died from signal 11 (SIGSEGV); the op is unknown, "
        "before it ran any case"), run.results[0].message


def test_the_number_of_children_is_bounded(fake_child) -> None:
    specs = ",".join(f"s{i:02}" for i in range(isolation.MAX_CHILDREN + 5))
    run = fake_child("crash_all", specs, FAKE_CHECKS="1")
    assert run.children == isolation.MAX_CHILDREN
    assert [o for _, o in _outcomes(run)] == ["error"] * (isolation.MAX_CHILDREN + 5)
    left = [r for r in run.results if r.message.startswith("not run:")]
    assert [str(r.id) for r in left] == [
        f"check_0-s{i:02}-model_level" for i in range(isolation.MAX_CHILDREN,
                                                       isolation.MAX_CHILDREN + 5)]
    assert {r.message for r in left} == {
        f"not run: offload-ref check stopped after {isolation.MAX_CHILDREN} processes running "
        f"its checks died (the errors above say what crashed)"}


def test_a_ctrl_c_the_child_did_not_get_is_forwarded_then_killed() -> None:
    child = subprocess.Popen([sys.executable, "-S", "-c", textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGINT, lambda *a: sys.exit(130))
        print("ready", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        ctrl_c = isolation._CtrlC()
        ctrl_c.tend(child)
        assert child.poll() is None  # no Ctrl-C yet
        ctrl_c.press()
        ctrl_c.tend(child)
        assert child.poll() is None and not ctrl_c.forwarded  # the child may have it already
        ctrl_c.first -= isolation._FORWARD_AFTER_S + 0.1
        ctrl_c.tend(child)
        assert ctrl_c.forwarded and child.wait(timeout=30) == 130
    finally:
        child.kill()
    stubborn = subprocess.Popen([sys.executable, "-S", "-c", textwrap.dedent("""
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert stubborn.stdout.readline() == "ready\n"
        ctrl_c = isolation._CtrlC()
        ctrl_c.press()
        ctrl_c.press()  # a second Ctrl-C: no more waiting
        ctrl_c.tend(stubborn)
        assert stubborn.wait(timeout=30) == -signal.SIGKILL
    finally:
        stubborn.kill()
