"""The `tether` console script ([project.scripts] in pyproject.toml) and ``python starter.py`` /
``python -m starter``: the command itself is the package tether/cli/."""

from tether.cli.main import cli_table, main, run  # cli_table: the README's CLI table (tests/docs/test_docs.py)

__all__ = ["cli_table", "main", "run"]

if __name__ == "__main__":
    run()
