"""Library logging etiquette: ddpkit adds only a NullHandler; the application decides."""

import logging
import os
import subprocess
import sys


def _run(code: str, env_extra=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DDPKIT_CLI_LOGGING", "DDPKIT_TERMINAL_COLUMNS")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


def test_import_adds_only_a_null_handler_and_keeps_propagation():
    out = _run(
        "import logging, ddpkit\n"
        "lg = logging.getLogger('ddpkit')\n"
        "print([type(h).__name__ for h in lg.handlers], lg.propagate,"
        " len(logging.getLogger().handlers))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['NullHandler'] True 0"


def test_basicconfig_file_sees_ddpkit_messages(tmp_path):
    logfile = tmp_path / "app.log"
    out = _run(
        "import logging, ddpkit\n"
        f"logging.basicConfig(filename={str(logfile)!r}, level=logging.INFO)\n"
        "from ddpkit.log import get_logger\n"
        "get_logger('ddpkit.user').info('hello from ddpkit')\n"
    )
    assert out.returncode == 0, out.stderr
    assert "[rank 0] hello from ddpkit" in logfile.read_text()
    assert "hello from ddpkit" not in out.stderr  # no handler of ddpkit's own


def test_caplog_sees_ddpkit_messages(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    from ddpkit.log import get_logger

    with caplog.at_level(logging.INFO, logger="ddpkit"):
        get_logger("ddpkit.test").warning("watch out")
    assert any("watch out" in r.getMessage() for r in caplog.records)


def test_cli_marked_processes_log_to_stderr():
    out = _run(
        "import ddpkit\nfrom ddpkit.log import get_logger\n"
        "get_logger('ddpkit.w').info('worker says hi')\n",
        {"DDPKIT_CLI_LOGGING": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert "INFO [rank 0] worker says hi" in out.stderr


def test_workers_of_a_launcher_on_a_terminal_log_the_message_alone_fitted_to_it():
    out = _run(
        "import ddpkit\nfrom ddpkit.log import get_logger\n"
        "get_logger('ddpkit.w').info('worker says hi')\n"
        "get_logger('ddpkit.w').warning('checkpoints are disabled: starting from step 0')\n",
        {"DDPKIT_CLI_LOGGING": "1", "DDPKIT_TERMINAL_COLUMNS": "30"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        "worker says hi", "warning: checkpoints are", "  disabled: starting from step",
        "  0"]


def test_the_terminal_formatter_keeps_other_ranks_names_and_whole_words():
    from ddpkit.log import TerminalFormatter

    def line(msg: str, level=logging.INFO) -> str:
        return TerminalFormatter(40).format(
            logging.LogRecord("ddpkit", level, "", 0, msg, None, None))

    assert line("[rank 0] epoch 1/2: train loss 0.5") == "epoch 1/2: train loss 0.5"
    assert line("[rank 1] stopped", logging.ERROR) == "error: [rank 1] stopped"
    path = "/a/" + "b" * 60
    assert line(f"[rank 0] run directory: {path}") == f"run directory:\n  {path}"
