"""CLI failures: one line on stderr and exit code 2."""


class CliError(Exception):
    """Bad input or an error the user must fix; printed as one line, exit code 2."""
