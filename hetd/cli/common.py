"""What the ``hetd`` command modules share: the admin URL's default, the exit codes, and argument
types."""

from __future__ import annotations

import argparse
import json
from typing import Any

DEFAULT_ADMIN_URL = "http://127.0.0.1:7071"

# Exit codes of the admin commands.
EXIT_REFUSED = 1  # the daemon answered with an error (bad token, bad policy, ...)
EXIT_USAGE = 2  # bad arguments or config
EXIT_UNREACHABLE = 3  # no daemon at the admin URL


def json_params(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("policy parameters must be a JSON object")
    return value


Sub = Any  # argparse's private _SubParsersAction
