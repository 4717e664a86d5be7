"""How long ``accel-ctx --help`` (and ``launch --help``, ``config --show``) takes over a bare
interpreter: the command must start without importing torch (target: <= 0.3 s over
``python -c pass``).

Runs are interleaved (bare, command, bare, command, ...) in fresh processes; the table gives the
median of each and the difference.

    python benchmarks/cli_help.py            # 15 runs each
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "--help": "from accel_ctx.cli import main; main(['--help'])",
    "launch --help": "from accel_ctx.cli import main; main(['launch', '--help'])",
    "config --show": "from accel_ctx.cli import main; main(['config', '--show'])",
}


def _seconds(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    print(f"{'accel-ctx':<16}{'bare ms':>9}{'command ms':>12}{'over bare ms':>14}")
    for name, code in COMMANDS.items():
        bare, command = [], []
        for _ in range(args.runs):
            bare.append(_seconds("pass"))
            command.append(_seconds(code))
        b, c = statistics.median(bare) * 1e3, statistics.median(command) * 1e3
        print(f"{name:<16}{b:>9.1f}{c:>12.1f}{c - b:>14.1f}")


if __name__ == "__main__":
    main()
