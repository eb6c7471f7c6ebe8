"""The README's "Install as a service" steps create every path the shipped units name, before the
units are enabled.

``systemd-analyze verify`` on the units as shipped fails on a machine without ``/opt/hetd/.venv``
("Command ... is not executable"); tests/integration/test_checkpoint.py verifies them pointed at
this checkout's venv. This test closes the gap: following the README in order, the program, the
config and the environment file each unit reads exist by the time ``systemctl enable`` runs.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def install_steps() -> list[str]:
    """The shell lines of the README's "Install as a service" section, in order (comments out)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Install as a service", 1)[1].split("\n## ", 1)[0]
    lines: list[str] = []
    for block in re.findall(r"```\n(.*?)```", section, flags=re.S):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                lines.append(line)
    return lines


def created_before_enable(steps: list[str], unit: str) -> set[str]:
    """Paths the steps create before the ``systemctl ... enable`` that starts ``unit``."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    made: set[str] = set()
    for line in steps:
        if "systemctl" in line and "enable" in line and unit in line:
            return made
        for cmd in (c.strip() for c in line.split("&&")):
            words = cmd.split()
            if words[:3] == ["python3", "-m", "venv"]:
                made.add(words[3])
            elif len(words) >= 3 and words[0].endswith("/bin/pip") and words[1] == "install":
                venv = words[0].rsplit("/bin/pip", 1)[0]
                made.update(f"{venv}/bin/{name}" for name in scripts)  # console scripts
            elif words[:1] == ["install"]:
                made.add(words[-1])
    raise AssertionError(f"the README never enables {unit}")


def named_paths(unit_text: str) -> set[str]:
    """The program of ExecStart, its --config file, and EnvironmentFile (required ones)."""
    paths: set[str] = set()
    for line in unit_text.splitlines():
        key, _, value = line.partition("=")
        if key == "ExecStart":
            words = value.split()
            paths.add(words[0])
            if "--config" in words:
                paths.add(words[words.index("--config") + 1])
        elif key == "EnvironmentFile" and not value.startswith("-"):
            paths.add(value)
    return paths


def test_the_readme_creates_what_each_unit_names_before_enabling_it() -> None:
    steps = install_steps()
    for unit, enabled_as in (("hetd.service", "hetd"), ("hetd-worker@.service", "hetd-worker@")):
        text = (ROOT / "systemd" / unit).read_text()
        needed = named_paths(text)
        assert needed, unit
        made = created_before_enable(steps, enabled_as)
        # the optional token file ("-/etc/hetd/tokens.env") is created by the README as well
        assert needed <= made, (unit, sorted(needed - made))
        # and the unit file itself is put where systemd reads it, from this repository's copy
        assert any(f"systemd/{unit}" in s and "/etc/systemd/system" in s for s in steps), unit


def writable_under(unit_text: str) -> list[str]:
    """The directories a unit with ProtectSystem=strict may write: its StateDirectory=,
    CacheDirectory= and ReadWritePaths= (and /tmp, private, with PrivateTmp=)."""
    settings: dict[str, list[str]] = {}
    for line in unit_text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            settings.setdefault(key.strip(), []).extend(value.split())
    assert settings.get("ProtectSystem") == ["strict"], "the unit's sandbox changed: revisit this"
    paths = [f"/var/lib/{d}" for d in settings.get("StateDirectory", [])]
    paths += [f"/var/cache/{d}" for d in settings.get("CacheDirectory", [])]
    paths += [p.lstrip("-") for p in settings.get("ReadWritePaths", [])]
    if settings.get("PrivateTmp") == ["yes"]:
        paths.append("/tmp")
    return paths


def test_the_readme_exports_where_the_daemon_unit_may_write() -> None:
    """README's `hetd export --out NAME` examples name a directory under the export root, the
    state directory's exports/, which the sandboxed daemon can write (ProtectSystem=strict makes
    the rest of the file system read-only for it)."""
    writable = writable_under((ROOT / "systemd" / "hetd.service").read_text())
    names = re.findall(r"hetd export --out (\S+)", (ROOT / "README.md").read_text())
    assert names, "README shows no hetd export --out"
    outs = [f"/var/lib/hetd/exports/{name}" for name in names if name not in ("NAME", "DIR")]
    assert outs and not [n for n in names if n.startswith("/")], names
    for out in outs:
        assert any(out == w or out.startswith(w.rstrip("/") + "/") for w in writable), (
            out,
            writable,
        )
