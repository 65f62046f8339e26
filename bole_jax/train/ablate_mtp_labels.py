"""MTP labels ablation at toy scale on CPU: the target's own distribution vs the data token.

    PYTHONPATH=. python -m bole_jax.train.ablate_mtp_labels OUT.json

Trains one tiny target (4 layers, hidden 64, 300 steps of 8 x 128 tokens, a 1024-token
tokenizer retrained on 21 standard-library packages) twice with the same seed (so the two
targets are identical), then its MTP head for 150 steps of 8 x 64 tokens with three unrolled
levels, once with --mtp-distill and once with --no-mtp-distill, and writes both validation
results. fp32, so that the CPU's emulated bf16 does not slow it down.
"""

import json
import sys
import sysconfig
from pathlib import Path

from bole_jax.train import train_demo as td

PACKAGES = (
    "email",
    "json",
    "asyncio",
    "unittest",
    "http",
    "xml",
    "logging",
    "importlib",
    "concurrent",
    "multiprocessing",
    "sqlite3",
    "urllib",
    "collections",
    "ctypes",
    "curses",
    "dbm",
    "html",
    "tomllib",
    "wsgiref",
    "xmlrpc",
    "zoneinfo",
)


def main(out: str) -> dict:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    base = (
        [
            "--size",
            "tiny",
            "--layers",
            "4",
            "--batch",
            "8",
            "--seq",
            "128",
            "--mtp-batch",
            "8",
            "--mtp-seq",
            "64",
            "--target-steps",
            "300",
            "--mtp-steps",
            "150",
            "--tokenizer-vocab",
            "1024",
            "--warmup",
            "50",
            "--mtp-warmup",
            "30",
            "--probe",
            "5",
            "--mtp-levels",
            "3",
            "--corpus",
        ]
        + [str(stdlib / p) for p in PACKAGES if (stdlib / p).is_dir()]
        + [
            "--max-bytes",
            "4000000",
            "--val-per-mille",
            "60",
            "--val-windows",
            "64",
            "--samples",
            "0",
            "--log-every",
            "100",
            "--compare-model",
            "none",
            "--lr",
            "3e-3",
            "--dtype",
            "float32",
        ]
    )
    res = {}
    for flag in ("--mtp-distill", "--no-mtp-distill"):
        r = td.main(["--out", str(Path(out).with_suffix("")) + flag] + base + [flag])
        res[flag] = dict(
            val_loss=r["val_loss"],
            val_top1=r.get("val_top1"),
            val_mtp=r["val_mtp"],
            mtp_last=r["mtp"]["curve"][-1],
        )
    Path(out).write_text(json.dumps(dict(args=base, results=res), indent=1))
    return res


if __name__ == "__main__":
    main(sys.argv[1])
