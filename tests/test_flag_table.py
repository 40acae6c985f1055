"""docs/configuration.md carries ``arguments.flag_table()`` verbatim between its flag markers
(``python scripts/update_flag_table.py`` rewrites that region), so the documented flags are the parser's."""
import pathlib
import subprocess
import sys

from megatron_dilocox.arguments import flag_table
import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"


def test_flag_table_in_docs_is_current():
    text = DOC.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, \
        f"docs/configuration.md needs one {BEGIN} ... {END} region; run scripts/update_flag_table.py after adding it"
    region = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert region.strip("\n") == flag_table(), "the flag table is stale: run scripts/update_flag_table.py"


def test_update_script_finds_a_stale_table_and_rewrites_it(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(DOC.read_text().replace("| `--dilocox` | off |", "| `--dilocox` | on |"))
    script = [sys.executable, str(ROOT / "scripts" / "update_flag_table.py")]
    check = subprocess.run(script + ["--check", str(stale)], capture_output=True, text=True)
    assert check.returncode == 1 and "out of date" in check.stderr
    assert subprocess.run(script + [str(stale)], capture_output=True).returncode == 0
    assert stale.read_text() == DOC.read_text()
    assert subprocess.run(script + ["--check", str(DOC)], capture_output=True).returncode == 0
