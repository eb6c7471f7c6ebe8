"""Configuration: typed sections with defaults, loaded from TOML and the environment.

Every key has a default, so ``hetd serve`` runs with no file; ``systemd/hetd.toml`` is a commented
example of every key. An unknown section or key, a value of the wrong type or out of range raises
:class:`ConfigError` naming it (and listing the valid keys). Tokens come from the file or from
``HETD_WORKER_TOKEN`` / ``HETD_ADMIN_TOKEN`` — never from the command line.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import ssl
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad configuration file, section, key or value."""


@dataclass(frozen=True)
class ServerConfig:
    """Where the daemon listens and what it accepts."""

    host: str = "127.0.0.1"
    port: int = 7070
    admin_host: str = "127.0.0.1"
    admin_port: int = 7071  # -1 disables the admin API; 0 picks a free port (tests)
    max_frame_bytes: int = 64 * 1024 * 1024  # websocket max_msg_size, set on both ends
    heartbeat_s: float = 2.0  # workers send a heartbeat this often
    heartbeat_timeout_s: float = 10.0  # a silent worker is dropped after this long
    outbox_frames: int = 16  # control frames queued per session before it is closed as stuck
    worker_token: str = ""  # empty: refused at start-up unless open_workers (the demo's way)
    admin_token: str = ""  # empty: admin API refuses every call but /healthz
    # With no worker token, any process that reaches the worker port joins and reads the model:
    # only when this says so, and only on loopback (demos). Tokens are 16 characters or more.
    open_workers: bool = False
    # The front (both ports): a client sends its request's headers (and ends its TLS handshake)
    # within header_timeout_s, and a request that has not shown a token ends within it; idle
    # keep-alive connections close after it. Connections that have shown no token yet are
    # "pending": at most max_pending of them, max_pending_per_address from one address (an IPv6
    # /64); over a cap the oldest is closed.
    header_timeout_s: float = 10.0
    max_pending: int = 256
    max_pending_per_address: int = 64
    # Token guessing: after max_auth_failures wrong tokens from one address within auth_window_s
    # (worker, admin and dashboard login together) it gets 429 until the window ends.
    max_auth_failures: int = 100
    auth_window_s: float = 60.0
    stop_timeout_s: float = 10.0  # bound on each step of a graceful stop (bye, checkpoint, close)
    # Departed workers: one that leaves before any push of it was answered leaves nothing behind;
    # the others are kept (to resume with their clock and push ids) for departed_retention_s,
    # at most max_departed of them (the longest gone go first).
    departed_retention_s: float = 86400.0
    max_departed: int = 4096
    # Decoding a push takes several times its frame's size in memory: at most max_decodes big
    # frames are decoded at once, holding at most decode_bytes of frames (one alone always may).
    max_decodes: int = 4
    decode_bytes: int = 256 * 1024 * 1024
    # TLS: PEM certificate (chain) and private key; both empty = plain ws:// and http://. Set, the
    # worker endpoint is wss:// and the admin API https://, both with this one certificate.
    tls_cert: str = ""
    tls_key: str = ""


@dataclass(frozen=True)
class TrainConfig:
    """What is trained and how the daemon applies updates."""

    # Your own model, loss, data and optimizer: a hetd.Task as "pkg.module:attr" or
    # "path/to/file.py:attr" (a Task, or a function returning one). Set, it replaces model,
    # dataset and their kwargs; every worker names the same task (hetd-worker --task).
    task: str = ""
    model: str = "mlp"  # registered name or pkg.module:attr
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    dataset: str = "mnist5k"  # registered name or pkg.module:attr
    dataset_kwargs: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    optimizer: str = "sgd"  # the daemon's optimizer for gradients: sgd | momentum | nesterov | adam
    lr: float = 0.1  # the daemon's optimizer learning rate
    # Local-step (delta) plans: the workers' optimizer, its state kept on the worker across
    # rounds; "" = the same family as optimizer. Spec "name[:lr=..,momentum=..,b1=..]".
    inner_optimizer: str = ""
    worker_lr: float = 0.0  # the inner optimizer's lr when its spec names none; 0: same as lr
    # How the daemon applies a delta: the pseudo-gradient -delta through this optimizer.
    # "sgd:lr=1" adds deltas as they are; "nesterov:lr=0.7,momentum=0.9" is DiLoCo's; "auto": the
    # policy's (policies.diloco.outer_for: Nesterov for diloco over an SGD-family inner optimizer,
    # plain averaging over adam and for every other policy, diloco_async included).
    outer_optimizer: str = "auto"
    micro_batch: int = 0  # examples per jitted call on workers (fixed shape); 0: batch_size
    global_batch: int = 128  # samples per round across workers (BSP: B/N each)
    batch_size: int = 32  # initial per-worker batch
    codec: str = "none"  # preferred codec for pushes and params
    downlink: str = "auto"  # lossy codecs' parameters: auto (by link speed), delta, full
    shards: int = 0  # data shards; 0 = one per worker slot, at least 4 (set it below 4 workers)
    eval_interval_s: float = 1.0  # the daemon evaluates the global model this often
    target_accuracy: float = 0.0  # > 0: log when reached
    max_staleness_drop: int = 1000  # pushes staler than this are dropped
    # The update guard: a push whose norm is over guard_factor x the median norm of the accepted
    # pushes of its kind (grad or delta) is refused (error out_of_range); 0 turns it off.
    guard_factor: float = 100.0
    guard_warmup: int = 20  # pushes of a kind accepted unjudged before the guard starts
    profile_steps: int = 3  # steps a joining worker times for its profile (0: no profiling)


@dataclass(frozen=True)
class PolicyConfig:
    """The policy to start with."""

    # auto: the daemon chooses among the synchronization policies as it measures the cluster
    # (docs/policies.md, auto); any registered policy may be named instead.
    name: str = "auto"
    # Empty: the policy's own defaults (ssp: staleness 3), so a file that names another policy
    # and no params starts it rather than handing it another's parameters.
    params: Mapping[str, Any] = field(default_factory=dict)
    # A policy that reads forecasts (auto) gets one this often: the planner runs its candidates
    # forward on the cluster's facts in a thread, within 5 % of one core (a round that cost more
    # delays the next ones). 0: no planning.
    plan_every_s: float = 30.0


@dataclass(frozen=True)
class StoreConfig:
    """Checkpoints (see :mod:`hetd.server.checkpoint`)."""

    dir: str = ""  # empty: no checkpoints; systemd: /var/lib/hetd (StateDirectory=hetd)
    interval_s: float = (
        60.0  # s between timed checkpoints; 0: only on SIGTERM and POST /v1/checkpoint
    )
    keep: int = 3  # newest checkpoints kept; older ones are deleted after each write
    # where hetd export (POST /v1/export) writes: "out" names a directory under it; empty: the
    # state directory's exports/ (and with no state directory either, exports are refused)
    export_dir: str = ""


@dataclass(frozen=True)
class PserversConfig:
    """Parameter servers ("pservers", see docs/design.md): the decision log and its link."""

    # keep the decision log: every decision the engine carries out, in order, for pservers to
    # replay; each checkpoint keeps the log's place and a restart goes on from it ([store] dir)
    log: bool = False
    # pserver processes (hetd pserver) that follow the log over the link (0: none); needs log
    servers: int = 0
    # the link pservers connect to (loopback only: it carries no token yet)
    host: str = "127.0.0.1"
    port: int = 7072
    # who starts the pserver processes: "none", the operator (hetd pserver, one per slice);
    # "local", the daemon: it spawns them on this host, each in <[store] dir>/pservers/slice<I>,
    # restarts one that exits (with a backoff; one that keeps failing is reported, not restarted)
    # and stops them when it stops; "ray" (pip install 'hetd[ray]'), the daemon starts them as
    # named Ray actors that Ray restarts (in the placement group of hetd cluster up, if any)
    backend: str = "none"
    # a push is decided once every pserver holds its part (workers send the parts); one whose
    # parts do not all come within this many seconds is dropped, everywhere
    part_timeout_s: float = 30.0
    # the head takes each push's header only (its worker, ids, sizes, timings): the tensors go to
    # the pservers alone, which report each part's squared norm for the update guard, and the
    # head holds no parameters (evaluations and exports pull them from the pservers; every worker
    # pulls its releases from them; no shared memory, no downlink deltas, no pipeline replicas)
    headers: bool = False


PSERVER_BACKENDS = ("none", "local", "ray")


@dataclass(frozen=True)
class Config:
    """The whole daemon configuration."""

    server: ServerConfig = field(default_factory=ServerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    pservers: PserversConfig = field(default_factory=PserversConfig)


_SECTIONS: dict[str, type[Any]] = {
    "server": ServerConfig,
    "train": TrainConfig,
    "policy": PolicyConfig,
    "store": StoreConfig,
    "pservers": PserversConfig,
}


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    where = f"[{section}] {key}"
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, str):
        ok = isinstance(value, str)
    elif isinstance(default, Mapping):
        ok = isinstance(value, Mapping)
    else:
        ok = True
    if not ok:
        raise ConfigError(
            f"{where} must be {type(default).__name__}, got {value!r} ({type(value).__name__})"
        )
    return value


def _section(name: str, raw: Any) -> Any:
    cls = _SECTIONS[name]
    if not isinstance(raw, Mapping):
        raise ConfigError(f"[{name}] must be a table")
    base = cls()
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - valid)
    if unknown:
        raise ConfigError(
            f"[{name}] unknown keys {unknown}; valid keys: {', '.join(sorted(valid))}"
        )
    values = {k: _coerce(name, k, v, getattr(base, k)) for k, v in raw.items()}
    return dataclasses.replace(base, **values)


def from_mapping(raw: Mapping[str, Any]) -> Config:
    """Build a :class:`Config` from parsed TOML; unknown sections or keys raise."""
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown sections {unknown}; valid sections: {', '.join(_SECTIONS)}")
    parts = {name: _section(name, raw[name]) for name in _SECTIONS if name in raw}
    return with_env(Config(**parts))


def load(path: str | Path | None) -> Config:
    """Read a TOML file (``None``: defaults only), then apply the environment."""
    if path is None:
        return with_env(Config())
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None
    return from_mapping(raw)


def with_env(cfg: Config) -> Config:
    """Tokens from ``HETD_WORKER_TOKEN`` / ``HETD_ADMIN_TOKEN`` override the file."""
    server = cfg.server
    wt = os.environ.get("HETD_WORKER_TOKEN")
    at = os.environ.get("HETD_ADMIN_TOKEN")
    if wt is not None:
        server = dataclasses.replace(server, worker_token=wt)
    if at is not None:
        server = dataclasses.replace(server, admin_token=at)
    return _checked(dataclasses.replace(cfg, server=server))


DOWNLINK_MODES = ("auto", "delta", "full")  # [train] downlink and the scenario key

# Allowed ranges, checked after the types: (section, key) -> (lowest, highest or None, why).
_RANGES: dict[tuple[str, str], tuple[float, float | None, str]] = {
    ("server", "port"): (0, 65535, "a TCP port, 0 for any free one"),
    ("server", "admin_port"): (-1, 65535, "a TCP port, 0 for any free one, -1 to disable"),
    ("server", "max_frame_bytes"): (1024, None, "at least 1024 bytes"),
    ("server", "heartbeat_s"): (1e-3, None, "positive seconds"),
    ("server", "heartbeat_timeout_s"): (1e-3, None, "positive seconds"),
    ("server", "outbox_frames"): (1, None, "at least 1"),
    ("server", "stop_timeout_s"): (0.1, None, "at least 0.1 s"),
    ("server", "header_timeout_s"): (0.1, None, "at least 0.1 s"),
    ("server", "max_pending"): (1, None, "at least 1"),
    ("server", "max_pending_per_address"): (1, None, "at least 1"),
    ("server", "max_auth_failures"): (1, None, "at least 1"),
    ("server", "auth_window_s"): (1, None, "at least 1 s"),
    ("server", "departed_retention_s"): (1, None, "at least 1 s"),
    ("server", "max_departed"): (0, None, "0 or more"),
    ("server", "max_decodes"): (1, None, "at least 1"),
    ("server", "decode_bytes"): (1024, None, "at least 1024 bytes"),
    ("train", "lr"): (0, None, "not negative"),
    ("train", "worker_lr"): (0, None, "not negative"),
    ("train", "global_batch"): (1, None, "at least 1"),
    ("train", "batch_size"): (1, None, "at least 1"),
    ("train", "micro_batch"): (0, None, "0 (the batch size) or more"),
    ("train", "shards"): (0, None, "0 (automatic) or more"),
    ("train", "eval_interval_s"): (0, None, "not negative"),
    ("train", "max_staleness_drop"): (0, None, "not negative"),
    ("train", "guard_factor"): (0, None, "0 (off) or a positive factor, e.g. 100"),
    ("train", "guard_warmup"): (0, None, "not negative"),
    ("train", "profile_steps"): (0, 20, "0 (no profiling) to 20 steps"),
    ("policy", "plan_every_s"): (0, None, "0 (no planning) or positive seconds"),
    ("store", "interval_s"): (0, None, "0 (no timer) or positive seconds"),
    ("store", "keep"): (1, None, "at least 1"),
    ("pservers", "servers"): (0, 64, "0 (none) to 64 pservers"),
    ("pservers", "port"): (0, 65535, "a TCP port, 0 for any free one"),
    ("pservers", "part_timeout_s"): (0.1, None, "at least 0.1 s"),
}


MIN_TOKEN = 16  # characters: a shorter token is refused at start-up
MAKE_TOKEN = (
    "make one with `hetd token` (or python -c 'import secrets; print(secrets.token_urlsafe(24))')"
)


def check_serving(cfg: Config) -> None:
    """What only a daemon about to listen needs (an admin client reading the same file needs only
    the admin token): a usable certificate; a state directory for a decision log; tokens of
    :data:`MIN_TOKEN` characters or more; a worker token, unless ``open_workers`` says to run
    without one on loopback (the demo's way)."""
    server = cfg.server
    server_ssl_context(server)  # the certificate and key are readable and match
    if cfg.pservers.log and not cfg.store.dir:
        raise ConfigError(
            "[pservers] log = true needs [store] dir (--state-dir): the log's records are "
            "forgotten once a checkpoint covers them, and each checkpoint keeps its place"
        )
    if not server.worker_token and not is_loopback(server.host):
        raise ConfigError(
            f"[server] worker_token is empty while host = {server.host!r} admits other "
            f"machines: set HETD_WORKER_TOKEN (or worker_token in the file); {MAKE_TOKEN}"
        )
    if not server.worker_token and not server.open_workers:
        raise ConfigError(
            "[server] worker_token is empty: set HETD_WORKER_TOKEN (or worker_token in the "
            f"file) and give workers the same; {MAKE_TOKEN}. To let any process on this machine "
            "join as a worker and read the model without one (a demo), set [server] "
            "open_workers = true (hetd serve --open-workers)"
        )
    for key in ("worker_token", "admin_token"):
        token = getattr(server, key)
        if token and len(token) < MIN_TOKEN:
            raise ConfigError(
                f"[server] {key} is {len(token)} characters: use a random one of at least "
                f"{MIN_TOKEN}; {MAKE_TOKEN}"
            )


def server_ssl_context(server: ServerConfig) -> ssl.SSLContext | None:
    """The daemon's TLS context from ``[server] tls_cert`` / ``tls_key`` (None: both empty, plain).
    A file that cannot be read, is not PEM, or a key that does not match the certificate raises
    :class:`ConfigError` in one line."""
    if not server.tls_cert:
        return None
    for key in ("tls_cert", "tls_key"):
        path = getattr(server, key)
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(
                f"[server] {key} = {path!r}: cannot read it: {exc.strerror}"
            ) from None

    def no_passphrase() -> bytes:
        raise ConfigError(
            f"[server] tls_key = {server.tls_key!r} is encrypted: give an unencrypted PEM key"
        )

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(server.tls_cert, server.tls_key, password=no_passphrase)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(
                f"[server] tls_key = {server.tls_key!r} does not match the certificate in "
                f"tls_cert = {server.tls_cert!r}"
            ) from None
        raise ConfigError(
            f"[server] tls_cert = {server.tls_cert!r} / tls_key = {server.tls_key!r}: not a PEM "
            f"certificate and its private key ({exc.reason or exc})"
        ) from None
    return ctx


def _checked(cfg: Config) -> Config:
    for (section, key), (low, high, why) in _RANGES.items():
        value = getattr(getattr(cfg, section), key)
        if value < low or (high is not None and value > high) or value != value:  # NaN
            raise ConfigError(f"[{section}] {key} = {value!r} is out of range: {why}")
    if bool(cfg.server.tls_cert) != bool(cfg.server.tls_key):
        raise ConfigError(
            "[server] tls_cert and tls_key go together: set both (PEM files) or neither (plain)"
        )
    if cfg.server.worker_token and cfg.server.worker_token == cfg.server.admin_token:
        raise ConfigError("the worker token and the admin token must differ")
    _check_pservers(cfg.pservers)
    # here, not at the top: codecs and optax are heavier than a config needs
    from hetd.codecs import registry as codecs
    from hetd.zoo.optim import parse_optimizer

    try:
        codecs.from_spec(cfg.train.codec)
    except codecs.CodecError as exc:
        raise ConfigError(f"[train] codec = {cfg.train.codec!r}: {exc}") from None
    for key in ("optimizer", "inner_optimizer", "outer_optimizer"):
        spec = getattr(cfg.train, key)
        if (key == "inner_optimizer" and not spec) or (key == "outer_optimizer" and spec == "auto"):
            continue
        try:
            parse_optimizer(spec)
        except ValueError as exc:
            raise ConfigError(f"[train] {key} = {spec!r}: {exc}") from None
    if cfg.train.downlink not in DOWNLINK_MODES:
        raise ConfigError(
            f"[train] downlink = {cfg.train.downlink!r}: one of {', '.join(DOWNLINK_MODES)}"
        )
    return cfg


def _check_pservers(p: PserversConfig) -> None:
    if p.backend not in PSERVER_BACKENDS:
        raise ConfigError(
            f"[pservers] backend = {p.backend!r}: one of {', '.join(map(repr, PSERVER_BACKENDS))} "
            '("none": you start each hetd pserver; "local": the daemon starts and restarts them; "ray": '
            "Ray actors do)"
        )
    if p.backend != "none" and p.servers < 1:
        raise ConfigError(
            f"[pservers] backend = {p.backend!r} needs servers >= 1: the processes it starts"
        )
    if p.servers > 0 and not p.log:
        raise ConfigError(
            f"[pservers] servers = {p.servers} needs log = true: pservers replay the decision log"
        )
    if p.headers and p.servers < 1:
        raise ConfigError(
            "[pservers] headers = true needs servers >= 1: the pservers hold the parameters then"
        )
    if p.servers > 0 and not is_loopback(p.host):
        raise ConfigError(
            f"[pservers] host = {p.host!r}: the pservers' link carries no token yet, so it "
            "listens on loopback only (127.0.0.1, ::1 or localhost)"
        )


def optimizers(
    optimizer: str,
    lr: float,
    inner: str,
    worker_lr: float,
    outer: str,
    policy: str = "",
    policy_params: Mapping[str, Any] | None = None,
    workers: int = 1,
) -> tuple[str, str, str]:
    """The three optimizer specs in full (each with its learning rate): the daemon's for
    gradients, the workers' inner one (``inner`` empty: ``optimizer``'s family; its lr
    ``worker_lr``, 0 meaning ``lr``) and the outer one for deltas (``"auto"``: the one
    :func:`policies.diloco.outer_for` gives ``policy`` with ``policy_params`` over ``workers``
    workers and this inner optimizer). Shared by the daemon and the simulator so both train the
    same way."""
    from hetd.zoo.optim import parse_optimizer
    from policies.diloco import AUTO_OUTER, outer_for

    daemon = parse_optimizer(optimizer).with_default_lr(lr)
    base = parse_optimizer(inner) if inner else parse_optimizer(daemon.name)
    inner_spec = base.with_default_lr(worker_lr or daemon.lr or lr)
    if outer == AUTO_OUTER:
        outer = outer_for(policy, policy_params or {}, workers, str(inner_spec))
    return str(daemon), str(inner_spec), str(parse_optimizer(outer).with_default_lr(1.0))


def worker_setup(cfg: Config) -> dict[str, Any]:
    """What every worker is told to build, from the config alone: ``model``, ``dataset`` and
    ``train``, the parts of ``welcome`` that do not depend on the worker (no id, shard or plan).
    The daemon serves it at ``GET /v1/prepare`` while it builds, so a worker loads its data and
    compiles its step meanwhile, and puts the same dict in every welcome."""
    t = cfg.train
    _, inner, _ = optimizers(t.optimizer, t.lr, t.inner_optimizer, t.worker_lr, t.outer_optimizer)
    if t.task:
        # A worker never imports what this names: it loads the task its own operator gave it
        # (hetd-worker --task) and compares it with the welcome's description, which the
        # daemon adds once it has loaded the task (hetd.server.build).
        return {
            "model": {"spec": t.task, "kwargs": {}, "task": {"spec": t.task}},
            "dataset": {"spec": "task", "kwargs": {}, "seed": t.seed},
            "train": {
                "worker_lr": t.worker_lr or t.lr,
                "seed": t.seed,
                "inner_optimizer": inner,
                "micro_batch": t.micro_batch or t.batch_size,
            },
        }
    return {
        "model": {"spec": t.model, "kwargs": dict(t.model_kwargs)},
        "dataset": {"spec": t.dataset, "kwargs": dict(t.dataset_kwargs), "seed": t.seed},
        "train": {
            "worker_lr": t.worker_lr or t.lr,
            "seed": t.seed,
            "inner_optimizer": inner,
            "micro_batch": t.micro_batch or t.batch_size,
        },
    }


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a name or an address) is this machine only: ``localhost``, 127.0.0.0/8,
    ``::1``. Used for the address a daemon listens on and for the address a worker came from."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def replace(cfg: Config, section: str, **values: Any) -> Config:
    """A copy of ``cfg`` with some keys of one section changed (checked like the file)."""
    merged = {**dataclasses.asdict(getattr(cfg, section)), **values}
    return _checked(dataclasses.replace(cfg, **{section: _section(section, merged)}))


def toml_value(v: Any) -> str:
    """One TOML value: a boolean, number, string, list or inline table of them."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float | str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise ValueError(f"cannot write {v!r} into TOML")


def toml_text(raw: dict[str, Any]) -> str:
    """``raw`` (tables of values) as TOML: ``tomllib.loads(toml_text(raw)) == raw``."""
    lines = []
    for section, table in raw.items():
        lines.append(f"[{section}]")
        lines.extend(f"{json.dumps(k)} = {toml_value(v)}" for k, v in table.items())
    return "\n".join(lines) + "\n"
