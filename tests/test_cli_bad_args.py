"""Every bad argument of ``offload-ref`` is a usage error: exit 2 and an ``error:`` line naming the
option, before any work (issue 37)."""

from __future__ import annotations

import pytest

from offload_ref.cli import main

BAD = [
    (["check", "--torch-threads", "0"], "--torch-threads: 0 is out of range"),
    (["check", "--torch-threads", "-5"], "--torch-threads: -5 is out of range"),
    (["check", "--torch-threads", "99999999999"], "--torch-threads: 99999999999 is out of range"),
    (["check", "--torch-threads", "two"], "--torch-threads: 'two' is not a whole number"),
    (["check", "--json", "/nonexistent/dir/x.json"], "the folder /nonexistent/dir does not exist"),
    (["bench", "--repeats", "0"], "--repeats: 0 is out of range (an int of at least 1)"),
    (["bench", "--blocks", "-1"], "--blocks: -1 is out of range"),
    (["bench", "--device", "quantum:7"], "--device: 'quantum:7' is not a device"),
    (["trace", "--pipeline", "flux2", "-o", "/nonexistent/dir/t.json"],
     "-o/--output: cannot write /nonexistent/dir/t.json"),
    (["trace", "--pipeline", "flux2", "-o", "t.json", "--torch-threads", "0"],
     "--torch-threads: 0 is out of range"),
    (["peers", "--repeats", "0"], "--repeats: 0 is out of range"),
    (["peers", "--markdown", "/nonexistent/dir/p.md"], "cannot write /nonexistent/dir/p.md"),
    (["plan", "--pipeline", "flux2", "--strategy", "auto", "--device-budget", "-3"],
     "--device-budget: -3 is out of range"),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_argument_is_a_usage_error_before_any_work(argv, words, capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"offload-ref {argv[0]}: error: argument " in err and words in err, err


def test_a_folder_given_as_an_output_file_is_refused(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["check", "--json", str(tmp_path)])
    assert exited.value.code == 2
    assert f"{tmp_path} is a folder, not a file" in capsys.readouterr().err



def _commands() -> dict:
    """Each command's parser, by name (the help tests below read them)."""
    import argparse

    from offload_ref.cli import _parser

    (sub,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_every_option_of_every_command_has_help_text() -> None:
    """``offload-ref X --help`` explains every option (issue 36: some printed a bare name)."""
    import argparse

    bare = [f"{name} {'/'.join(action.option_strings) or action.dest}"
            for name, command in _commands().items() for action in command._actions
            if not isinstance(action, argparse._HelpAction) and not action.help]
    assert bare == []


def test_trace_help_says_it_traces_one_pipeline_under_one_strategy() -> None:
    helps = {a.option_strings[0]: a.help for a in _commands()["trace"]._actions
             if a.option_strings}
    assert "exactly one" in helps["--pipeline"] and "default: all" not in helps["--pipeline"]
    assert "once" in helps["--strategy"] and "repeatable" not in helps["--strategy"]


def test_the_top_level_synopsis_names_every_option() -> None:
    """``offload-ref --help`` lists each command with its options; a new option must join it."""
    import argparse
    import re

    from offload_ref import cli

    missing = [f"{name} {action.option_strings}" for name, command in _commands().items()
               for action in command._actions
               if action.option_strings and not isinstance(action, argparse._HelpAction)
               and not any(re.search(re.escape(o) + r"(?![\w-])", cli.__doc__)
                           for o in action.option_strings)]
    assert missing == []
