"""The files the daemon writes (issue 35, items 5 and 10): exports only under the export root,
never through a symlink, temp files created exclusively; checkpoints 0600 whatever the umask."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hetd import config
from hetd.server import checkpoint, export, safe_files
from hetd.server.safe_files import Refused


def _cfg(state_dir: Path | None = None, export_dir: Path | None = None) -> config.Config:
    return config.replace(
        config.Config(), "store", dir=str(state_dir or ""), export_dir=str(export_dir or "")
    )


def _captured(version: int = 1) -> export.Captured:
    params = {"dense/w": np.ones((2, 3), np.float32), "dense/b": np.zeros(3, np.float32)}
    opt_state = {"count": np.zeros((), np.int32)}
    return export.Captured(params, opt_state, version, {"name": "asp"}, 0, 0, "")


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_exports_go_under_the_state_dirs_exports_or_the_configured_root(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert export.target(_cfg(state), "model") == (state / "exports" / "model").resolve()
    assert export.target(_cfg(state), "runs/a") == (state / "exports" / "runs" / "a").resolve()
    own = tmp_path / "own"
    assert export.target(_cfg(state, own), "./m") == (own / "m").resolve()
    with pytest.raises(Refused, match=r"no export root.*--state-dir.*export_dir") as info:
        export.target(_cfg(), "model")
    assert (info.value.status, info.value.code) == (409, "no_export_root")


@pytest.mark.parametrize(
    "out", ["/tmp/hetd-evil", "../evil", "a/../../evil", "a/..", ".", "~/evil", "a\x00b", "a\nb"]
)
def test_absolute_dotdot_and_odd_names_are_refused(tmp_path: Path, out: str) -> None:
    root = tmp_path / "state" / "exports"
    with pytest.raises(Refused) as info:
        export.target(_cfg(tmp_path / "state"), out)
    assert (info.value.status, info.value.code) == (400, "bad_out")
    assert f"exports go under {root}" in str(info.value)
    assert _tree(tmp_path) in ([], ["state"], ["state", "state/exports"])  # nothing else made


def test_a_symlinked_component_is_refused_and_not_followed(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "state" / "exports", tmp_path / "elsewhere"
    elsewhere.mkdir()
    root.mkdir(parents=True)
    (root / "runs").mkdir()
    (root / "runs" / "link").symlink_to(elsewhere)
    with pytest.raises(Refused, match="'runs/link' under the export root is a symbolic link"):
        export.target(_cfg(tmp_path / "state"), "runs/link/model")
    (root / "file").write_text("x")
    with pytest.raises(Refused, match="'file' is not a directory"):
        export.target(_cfg(tmp_path / "state"), "file/model")
    assert list(elsewhere.iterdir()) == []


def test_an_export_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    """Links planted at the old fixed temp names and at the final names: their targets stay as
    they were; the export's files are regular files of its own."""
    cfg = _cfg(tmp_path / "state")
    out = tmp_path / "state" / "exports" / "model"
    out.mkdir(parents=True)
    victims = {}
    for name in (".params.msgpack.tmp", ".model.json.tmp", "params.msgpack", "model.json"):
        victim = tmp_path / f"victim-{name.strip('.')}"
        victim.write_text("precious")
        (out / name).symlink_to(victim)
        victims[name] = victim
    reply = export.write("model", _captured(), cfg)
    assert reply["dir"] == str(out.resolve())
    assert reply["params_msgpack"] == str(out.resolve() / "params.msgpack")
    for victim in victims.values():
        assert victim.read_text() == "precious", victim
    for name in ("params.msgpack", "model.json"):
        assert stat.S_ISREG(os.lstat(out / name).st_mode), name
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]


def test_a_temp_file_is_created_exclusively(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target")  # dangling: O_CREAT alone would create its target
    with pytest.raises(FileExistsError):
        safe_files.create_exclusive(link)
    assert not (tmp_path / "target").exists()

    def fails(fh: object) -> int:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        safe_files.write_atomic(tmp_path / "out", fails)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]  # no temp file left


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077])
def test_a_checkpoint_is_0600_whatever_the_umask(tmp_path: Path, mask: int) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    directory = tmp_path / "state"
    directory.mkdir()
    (directory / ".ckpt-00000001-v5.msgpack.tmp").symlink_to(victim)  # the old fixed temp name
    state = {
        "version": 5,
        "created_unix": 1.0,
        "params": {"w": np.ones(4, np.float32)},
        "opt_state": {},
    }
    with umask(mask):
        info = checkpoint.write(directory, state, keep=2)
    assert stat.S_IMODE(os.stat(info.path).st_mode) == 0o600
    assert victim.read_text() == "precious"
    assert checkpoint.load_newest(directory) is not None
