"""The README's two commands: the first runs the main job, the second the tests, and .ci/run runs the second one
verbatim."""

from __future__ import annotations

from tests import ROOT


def readme_commands() -> list[str]:
    """The README's first two ```bash blocks."""
    readme = (ROOT / "README.md").read_text()
    return [block.split("```", 1)[0].strip() for block in readme.split("```bash\n")[1:3]]


def test_readme_first_command_runs_the_main_job_and_second_the_tests():
    main_job, tests = readme_commands()
    assert main_job.endswith("python run.py")
    assert tests.endswith("python -m pytest -q")


def test_ci_runs_the_readme_test_command_verbatim():
    _, tests = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in ci if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert commands == [tests]
