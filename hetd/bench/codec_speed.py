"""Codec benchmark: each codec's encode and decode speed against memcpy, measured side by side.

Owns ``codecs.json`` (docs/benchmark.md): one record per codec spec and tensor size::

    {"codec": spec, "n": floats, "encode_gbps", "decode_gbps", "roundtrip_gbps", "memcpy_gbps",
     "roundtrip_vs_memcpy", "memcpy_hot_gbps", "memcpy_large_gbps", "ratio", "rel_error"}

GB/s counts float32 bytes processed (``4 n``) per second; each time is the best of ``repeats``
runs after a warm-up, the runs of all codecs and of memcpy interleaved round by round so that
load from other processes hits them alike; memcpy is ``np.copyto`` of the same ``n`` floats
timed in the same rounds as the codecs. Two more memcpy figures bracket it:
``memcpy_hot_gbps`` runs back to back, both buffers staying in cache (an upper bound for sizes
that fit in the last-level cache), and ``memcpy_large_gbps`` copies 400 MB, out of cache, the limit
docs/benchmark.md quotes. ``roundtrip`` is encode then decode
(``4 n / (t_encode + t_decode)``). ``ratio`` is encoded payload bytes / float32 bytes and
``rel_error`` is ``||x - decode(encode(x))|| / ||x||`` on standard normal data. Decoding goes
through :func:`hetd.codecs.registry.decode_tensor`, checks included, as the daemon runs it.

Run ``python -m hetd.bench.codec_speed --out DIR``. Fresh memory is slow: run with
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set as for the daemon (docs/benchmark.md),
or the 10M rows measure page faults rather than codecs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetd.codecs import registry as codecs

SPECS: tuple[str, ...] = (
    "none",
    "fp16",
    "bf16",
    "int8",
    "int8:block=1024",
    "int8:stochastic=true",
    "int4",
    "sign",
    "topk:k=0.01",
    "topk:k=0.01,values=int8",
)
SIZES: tuple[int, ...] = (1_000_000, 10_000_000)


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _gbps(n: int, seconds: float) -> float:
    return round(4 * n / seconds / 1e9, 3)


def _best_interleaved(jobs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The fastest of ``repeats`` timed calls of each job, after one warm-up call each. Rounds
    run every job in turn, so a burst of load from another process hits all of them alike and
    the ratios between them stay fair."""
    for fn in jobs.values():
        fn()
    best = dict.fromkeys(jobs, float("inf"))
    for _ in range(repeats):
        for name, fn in jobs.items():
            best[name] = min(best[name], _seconds(fn))
    return best


def _copy_job(src: np.ndarray, dst: np.ndarray) -> Callable[[], object]:
    return lambda: np.copyto(dst, src)


def _jobs(
    spec: str, x: np.ndarray, seed: int
) -> tuple[dict[str, Callable[[], object]], float, float]:
    """Encode and decode jobs of codec ``spec`` on ``x``, with its ratio and rel_error."""
    codec = codecs.from_spec(spec)
    rng = np.random.default_rng(seed)
    wire = codec.encode(x, rng)
    out = codecs.decode_tensor(wire, spec).astype(np.float64)
    err = float(np.linalg.norm(out - x) / np.linalg.norm(x.astype(np.float64)))
    jobs: dict[str, Callable[[], object]] = {
        f"encode {spec}": lambda: codec.encode(x, rng),
        f"decode {spec}": lambda: codecs.decode_tensor(wire, spec),
    }
    return jobs, codecs.payload_nbytes(wire) / x.nbytes, err


def large_memcpy_gbps(mb: int = 400, repeats: int = 3) -> float:
    """memcpy GB/s on a buffer far bigger than the caches (docs/benchmark.md's limit, 400 MB)."""
    src = np.ones(mb * 2**20 // 4, np.float32)
    dst = np.zeros_like(src)
    dst.fill(1.0)  # fault the pages in before timing
    return _gbps(src.size, _best_interleaved({"memcpy": _copy_job(src, dst)}, repeats)["memcpy"])


def run_codec_bench(
    sizes: Sequence[int] = SIZES,
    repeats: int = 5,
    specs: Sequence[str] = SPECS,
    seed: int = 0,
    large_memcpy_mb: int = 400,
) -> list[dict[str, Any]]:
    """Time every codec spec in ``specs`` on ``n`` standard normal floats for each ``n`` in
    ``sizes``; one record per (spec, n), in that order (see the module docstring). With
    ``large_memcpy_mb`` > 0 each record also carries ``memcpy_large_gbps``: memcpy of that many
    MB, out of cache, measured once in this run (0 skips it)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    large = large_memcpy_gbps(large_memcpy_mb) if large_memcpy_mb > 0 else None
    records: list[dict[str, Any]] = []
    for n in sizes:
        x = np.random.default_rng(seed).standard_normal(n, dtype=np.float32)
        jobs = {"memcpy": _copy_job(x, np.empty_like(x))}
        hot_s = _best_interleaved(jobs, repeats)["memcpy"]  # back to back: both buffers in cache
        quality = {}
        for spec in specs:
            codec_jobs, ratio, err = _jobs(spec, x, seed + 1)
            jobs.update(codec_jobs)
            quality[spec] = (ratio, err)
        best = _best_interleaved(jobs, repeats)
        memcpy_s = best["memcpy"]
        rows = [
            (spec, best[f"encode {spec}"], best[f"decode {spec}"], *quality[spec]) for spec in specs
        ]
        del jobs
        for spec, encode_s, decode_s, ratio, err in rows:
            record = {
                "codec": spec,
                "n": n,
                "encode_gbps": _gbps(n, encode_s),
                "decode_gbps": _gbps(n, decode_s),
                "roundtrip_gbps": _gbps(n, encode_s + decode_s),
                "memcpy_gbps": _gbps(n, memcpy_s),
                "roundtrip_vs_memcpy": round(memcpy_s / (encode_s + decode_s), 3),
                "memcpy_hot_gbps": _gbps(n, hot_s),
                "ratio": round(ratio, 5),
                "rel_error": float(f"{err:.4g}"),
            }
            if large is not None:
                record["memcpy_large_gbps"] = large
            records.append(record)
    return records


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """The records as a Markdown table a person reads."""
    cols = (
        "codec",
        "n",
        "encode_gbps",
        "decode_gbps",
        "roundtrip_gbps",
        "memcpy_gbps",
        "roundtrip_vs_memcpy",
        "memcpy_hot_gbps",
        "ratio",
        "rel_error",
    )
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in records]
    return "\n".join(lines)


def write_codec_bench(
    out_dir: str | Path,
    sizes: Sequence[int] = SIZES,
    repeats: int = 5,
    large_memcpy_mb: int = 400,
) -> Path:
    """Run :func:`run_codec_bench` and write ``out_dir/codecs.json``; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "codecs.json"
    records = run_codec_bench(sizes, repeats, large_memcpy_mb=large_memcpy_mb)
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hetd.bench.codec_speed --out DIR [--sizes 1000000,10000000] [--repeats 5]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True, help="directory for codecs.json")
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, SIZES)),
        help="comma-separated tensor sizes in floats (default: %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement")
    parser.add_argument(
        "--large-memcpy-mb", type=int, default=400, help="out-of-cache memcpy size (0 skips it)"
    )
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes must be comma-separated ints, got {args.sizes!r}")
    if not sizes or min(sizes) < 1:
        parser.error("--sizes needs at least one positive size")
    path = write_codec_bench(args.out, sizes, args.repeats, args.large_memcpy_mb)
    records = json.loads(path.read_text())
    print(format_table(records))
    if records and "memcpy_large_gbps" in records[0]:
        print(f"memcpy of {args.large_memcpy_mb} MB: {records[0]['memcpy_large_gbps']} GB/s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
