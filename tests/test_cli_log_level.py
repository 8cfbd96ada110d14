"""``kvforge --log-level``: the engine's log records (the plugins chosen, the weights' memory, the
KV blocks) on stderr, which a CLI user otherwise never sees; stdout stays the generated text."""
from __future__ import annotations

import logging
import re

import pytest

from helpers import STORIES_MODEL
from kvforge.entrypoints.cli import main as cli_main


@pytest.fixture
def restore_kvforge_logger():
    log = logging.getLogger("kvforge")
    handlers, level = list(log.handlers), log.level
    yield
    log.handlers[:], log.level = handlers, level


def test_log_level_info_shows_the_load_report(capsys, restore_kvforge_logger):
    rc = cli_main(["--log-level", "info", "generate", "--model", STORIES_MODEL, "--max-tokens", "3", "Once upon"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "'quantizer': 'unquantized'" in out.err
    assert re.search(r"weights \d+\.\d\d (KiB|MiB),", out.err)  # (~1 MB: not "0.001 GiB")
    assert "INFO" not in out.out and out.out.startswith("Once upon")


def test_log_level_twice_in_one_process_prints_each_record_once(capsys, restore_kvforge_logger):
    for _ in range(2):
        assert cli_main(["--log-level", "info", "generate", "--model", STORIES_MODEL, "--max-tokens", "2", "x"]) == 0
    assert capsys.readouterr().err.count("kvforge engine: ") == 2  # one per run, not 1 + 2


def test_no_log_level_keeps_stderr_free_of_records(capsys, restore_kvforge_logger):
    rc = cli_main(["generate", "--model", STORIES_MODEL, "--max-tokens", "3", "Once upon"])
    out = capsys.readouterr()
    assert rc == 0 and "INFO kvforge" not in out.err


def test_bad_log_level_refused(capsys):
    with pytest.raises(SystemExit):
        cli_main(["--log-level", "loud", "generate", "--model", STORIES_MODEL, "x"])
    assert "--log-level: invalid choice: 'loud'" in capsys.readouterr().err
