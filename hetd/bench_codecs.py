"""Codec benchmark: each codec's encode and decode speed against memcpy, measured side by side.

Owns ``codecs.json`` (BENCHMARK.md §2): one record per codec spec and tensor size::

    {"codec": spec, "n": floats, "encode_gbps", "decode_gbps", "roundtrip_gbps", "memcpy_gbps",
     "roundtrip_vs_memcpy", "ratio", "rel_error"}

GB/s counts float32 bytes processed (``4 n``) per second; each time is the best of ``repeats``
runs after a warm-up; memcpy is ``np.copyto`` of the same ``n`` floats, measured in the same run
(best of its runs before and after the codecs, as timings drift). ``roundtrip`` is encode then
decode (``4 n / (t_encode + t_decode)``). ``ratio`` is encoded payload bytes / float32 bytes and
``rel_error`` is ``||x - decode(encode(x))|| / ||x||`` on standard normal data. Decoding goes
through :func:`hetd.codecs.decode_tensor`, checks included, as the daemon runs it.

Run ``python -m hetd.bench_codecs --out DIR``. Fresh memory is slow on these machines: run with
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set as for the daemon (BENCHMARK.md §3),
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

from hetd import codecs

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


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _gbps(n: int, seconds: float) -> float:
    return round(4 * n / seconds / 1e9, 3)


def _memcpy_seconds(x: np.ndarray, dst: np.ndarray, repeats: int) -> float:
    return _best_seconds(lambda: np.copyto(dst, x), repeats)


def _measure(
    spec: str, x: np.ndarray, repeats: int, seed: int
) -> tuple[float, float, float, float]:
    """(encode seconds, decode seconds, ratio, rel_error) of codec ``spec`` on ``x``."""
    codec = codecs.from_spec(spec)
    rng = np.random.default_rng(seed)
    wire = codec.encode(x, rng)
    encode_s = _best_seconds(lambda: codec.encode(x, rng), repeats)
    decode_s = _best_seconds(lambda: codecs.decode_tensor(wire, spec), repeats)
    out = codecs.decode_tensor(wire, spec).astype(np.float64)
    err = float(np.linalg.norm(out - x) / np.linalg.norm(x.astype(np.float64)))
    return encode_s, decode_s, codecs.payload_nbytes(wire) / x.nbytes, err


def large_memcpy_gbps(mb: int = 400, repeats: int = 3) -> float:
    """memcpy GB/s on a buffer far bigger than the caches (BENCHMARK.md §2's limit, 400 MB)."""
    src = np.ones(mb * 2**20 // 4, np.float32)
    dst = np.zeros_like(src)
    dst.fill(1.0)  # fault the pages in before timing
    return _gbps(src.size, _memcpy_seconds(src, dst, repeats))


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
        dst = np.empty_like(x)
        memcpy_s = _memcpy_seconds(x, dst, repeats)
        rows = [(spec, *_measure(spec, x, repeats, seed + 1)) for spec in specs]
        memcpy_s = min(memcpy_s, _memcpy_seconds(x, dst, repeats))
        for spec, encode_s, decode_s, ratio, err in rows:
            record = {
                "codec": spec,
                "n": n,
                "encode_gbps": _gbps(n, encode_s),
                "decode_gbps": _gbps(n, decode_s),
                "roundtrip_gbps": _gbps(n, encode_s + decode_s),
                "memcpy_gbps": _gbps(n, memcpy_s),
                "roundtrip_vs_memcpy": round(memcpy_s / (encode_s + decode_s), 3),
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
    """``python -m hetd.bench_codecs --out DIR [--sizes 1000000,10000000] [--repeats 5]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True, help="directory for codecs.json")
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, SIZES)),
        help="comma-separated tensor sizes in floats (default: %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes must be comma-separated ints, got {args.sizes!r}")
    if not sizes or min(sizes) < 1:
        parser.error("--sizes needs at least one positive size")
    path = write_codec_bench(args.out, sizes, args.repeats)
    print(format_table(json.loads(path.read_text())))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
