"""The README's first code block holds exactly the two commands, and CI runs the second one."""
import pathlib
import re
import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_commands():
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_command():
    main_job, tests = readme_commands()
    assert main_job == "bash scripts/main_job.sh" and tests == "bash scripts/test.sh"
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [tests]
    for cmd in (main_job, tests):
        assert (ROOT / cmd.split()[1]).exists()
