"""``hetd serve`` logs its events at INFO by default, ``-q`` keeps warnings, ``-v`` is DEBUG; the
other commands stay at warnings (a progress bar is not interleaved with join lines)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from hetd.cli.main import parser, setup_logging

NAMES = ("hetd", "absl", "")


@pytest.fixture(autouse=True)
def restore_levels() -> Iterator[None]:
    saved = {n: logging.getLogger(n).level for n in NAMES}
    handlers = list(logging.getLogger().handlers)
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger().handlers[:] = handlers


@pytest.mark.parametrize(
    ("argv", "hetd_level"),
    [
        (["serve"], logging.INFO),
        (["serve", "-q"], logging.WARNING),
        (["-q", "serve"], logging.WARNING),
        (["demo"], logging.WARNING),
        (["status"], logging.WARNING),
    ],
)
def test_default_and_quiet_levels(argv: list[str], hetd_level: int) -> None:
    args = parser().parse_args(argv)
    setup_logging(args.command, args.verbose, args.quiet_log)
    assert logging.getLogger("hetd.server.daemon").getEffectiveLevel() == hetd_level
    assert logging.getLogger("aiohttp.access").getEffectiveLevel() >= logging.WARNING
    assert logging.getLogger("absl").getEffectiveLevel() == logging.ERROR


def test_verbose_is_debug_everywhere() -> None:
    logging.getLogger("hetd").setLevel(logging.NOTSET)
    logging.getLogger().setLevel(logging.WARNING)
    args = parser().parse_args(["serve", "-v"])
    setup_logging(args.command, args.verbose, args.quiet_log)
    assert logging.getLogger("hetd.core.engine").isEnabledFor(logging.DEBUG)
    assert logging.getLogger("absl").isEnabledFor(logging.DEBUG)
