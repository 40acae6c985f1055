"""README.md carries ``arguments.flag_table()`` verbatim between its flag markers
(``python scripts/update_readme_flags.py`` rewrites that region)."""
import pathlib

from megatron_dilocox.arguments import flag_table

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"


def test_readme_flag_table_is_current():
    text = (ROOT / "README.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, \
        f"README.md needs one {BEGIN} ... {END} region; run scripts/update_readme_flags.py after adding it"
    region = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert region.strip("\n") == flag_table(), "README flag table is stale: run scripts/update_readme_flags.py"
