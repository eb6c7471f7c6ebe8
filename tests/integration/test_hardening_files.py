"""What a real daemon writes, through its admin API (issue 35, items 5 and 10): ``POST /v1/export``
writes only under the export root (the state directory's ``exports/``), refusing absolute paths,
``..`` and symlinked components with 400; ``hetd export`` says where the model went; a checkpoint
is 0600."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import Cluster
from tests.integration.test_admin import call, hetd_cli

pytestmark = pytest.mark.slow


async def test_exports_stay_under_the_export_root_and_checkpoints_are_private(
    cluster: Any, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    c: Cluster = await cluster("asp", store={"dir": str(state)})
    root = state / "exports"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    async with aiohttp.ClientSession() as http:
        bad = [str(elsewhere / "abs"), "../escaped", "a/../../escaped", "~/x"]
        for out in bad:
            status, reply = await call(http, c, "POST", "/v1/export", {"out": out})
            assert status == 400 and reply["error"] == "bad_out", (out, reply)
            assert f"exports go under {root}" in reply["message"], reply
        root.mkdir(parents=True, exist_ok=True)
        (root / "link").symlink_to(elsewhere)
        status, reply = await call(http, c, "POST", "/v1/export", {"out": "link/model"})
        assert status == 400 and "is a symbolic link" in reply["message"], reply
        assert list(elsewhere.iterdir()) == []
        assert not (tmp_path / "escaped").exists() and not (state / "escaped").exists()

        status, reply = await call(http, c, "POST", "/v1/checkpoint")
        assert status == 200, reply
        assert stat.S_IMODE(os.stat(reply["path"]).st_mode) == 0o600

    # the command line: a name under the root (default "model"); it prints where the files went
    code, stdout, err = await hetd_cli("export", "--admin-url", c.admin_url)
    assert code == 0, err
    where = (root / "model").resolve()
    assert f"to {where} (orbax step" in stdout and f"{where}/params.msgpack" in stdout, stdout
    assert (where / "params.msgpack").is_file() and (where / "model.json").is_file()
    code, _, err = await hetd_cli(
        "export", "--out", str(tmp_path / "x"), "--admin-url", c.admin_url
    )
    assert code == 1 and "400 bad_out" in err and "is an absolute path" in err, err
