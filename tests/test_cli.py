"""Usage errors (missing or unknown options and arguments) end in click's short usage message
and exit code 2, never a traceback - whichever click (plain, or typer's vendored copy) parsed
the command line."""

import pytest

from qfd.cli import main


@pytest.mark.parametrize(
    "argv, words",
    [
        (["info"], "Missing argument"),
        (["draft", "train", "--target", "x", "--out", "y"], "Missing option '--stage'"),
        (["generate", "--bogus"], "No such option: --bogus"),
        (["draft", "train", "--stage", "one", "--target", "x", "--out", "y"], "Invalid value for '--stage'"),
    ],
)
def test_usage_errors_exit_2_without_traceback(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    captured = capsys.readouterr()
    assert exc.value.code == 2
    assert words in captured.err and "Traceback" not in captured.err + captured.out
    errors = [line for line in captured.err.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, captured.err
