"""`kvpage serve --replicas`: with one replica (the default) the single server is untouched and Ray
is never imported; flags that need replicas, or that replicas cannot take, are usage errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpage import cli

NO_RAY = """
import sys
from kvpage import cli
from kvpage.cli.serve import check_replica_args
args = cli.build_parser().parse_args(["serve"])
check_replica_args(args)
import kvpage.server, kvpage.serve_replicas.prefix_router, kvpage.serve_replicas.routing_key
import kvpage.serve_replicas.asgi_call, kvpage.serve_replicas.metrics_merge
assert args.replicas == 1, args.replicas
print("ray imported" if "ray" in sys.modules else "no ray")
"""


def test_one_replica_never_imports_ray():
    out = subprocess.run(
        [sys.executable, "-c", NO_RAY], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no ray"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--router", "prefix"], "--router needs --replicas > 1"),
        (["--ray-address", "auto"], "--ray-address needs --replicas > 1"),
        (["--replicas", "2", "--tensor-parallel-size", "2"], "not supported"),
        (["--replicas", "0"], "must be >= 1"),
        (["--replicas", "2", "--router", "random"], "invalid choice"),
    ],
)
def test_bad_replica_flags_are_one_error_line(argv, message, capsys):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
