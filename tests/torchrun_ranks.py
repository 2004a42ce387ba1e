"""The ranks torchrun starts for `python -m octopipe.cli WORDS`, without torchrun's start-up.

Each torchrun run in a test cost about 7 s here, 5 of them in Python starting and importing torch
and octopipe again (torchrun itself, then each rank). `run_ranks` hands the ranks what torchrun
hands them (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, the working
folder, `python -m octopipe.cli` as `__main__`), but forks them from a server process that imported
`octopipe.cli` once per test worker (as multiprocessing's forkserver does). The ranks are fresh
processes in every other respect: the server ran nothing but those imports.

What only torchrun's agent does (forwarding signals, ending the other ranks when one fails, its
"Root Cause" report) is tested with the real torchrun; see `tests/test_cli.py::_torchrun`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Ranks:
    """What `subprocess.run` gives for torchrun: the ranks' merged output and the job's code."""

    returncode: int
    stdout: str
    stderr: str
    codes: list[int]


def _serve() -> None:
    """The server: import what a rank imports, then fork ranks for each request on stdin."""
    import runpy
    import traceback

    import octopipe.cli  # noqa: F401 - the imports every rank makes, done once

    # run as `__main__` below, as `python -m` runs it, and found in no other name
    del sys.modules["octopipe.cli"]
    del sys.modules["octopipe"].cli

    channel = os.fdopen(os.dup(1), "w")
    requests = os.fdopen(os.dup(0), "r")
    null = os.open(os.devnull, os.O_RDONLY)
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for env in request["ranks"]:
            pid = os.fork()
            if pid == 0:  # a rank: as `python -m octopipe.cli WORDS` started in the folder
                code = 1
                try:
                    os.chdir(request["cwd"])
                    os.environ.clear()
                    os.environ.update(env)
                    os.dup2(null, 0)
                    os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_APPEND), 1)
                    os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_APPEND), 2)
                    sys.path[0] = os.getcwd()
                    sys.argv = ["octopipe.cli", *request["words"]]
                    try:
                        runpy.run_module("octopipe.cli", run_name="__main__", alter_sys=True)
                        code = 0
                    except SystemExit as exc:
                        if isinstance(exc.code, str):
                            print(exc.code, file=sys.stderr)
                        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                    except BaseException:  # noqa: BLE001 - as the interpreter would report it
                        traceback.print_exc()
                        code = 1
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            pids.append(pid)
        channel.write(json.dumps({"pids": pids}) + "\n")
        channel.flush()
        codes = []
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            codes.append(os.waitstatus_to_exitcode(status))
        channel.write(json.dumps({"codes": codes}) + "\n")
        channel.flush()


_server: subprocess.Popen[str] | None = None


def _started_server() -> subprocess.Popen[str]:
    global _server
    if _server is None or _server.poll() is not None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        _server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, env=env, cwd=ROOT)
    return _server


def _line(server: subprocess.Popen[str], timeout_s: float) -> dict[str, list[int]]:
    assert server.stdout is not None
    ready, _, _ = select.select([server.stdout], [], [], timeout_s)
    line = server.stdout.readline() if ready else ""
    if not line:
        raise TimeoutError
    return json.loads(line)


def run_ranks(words: list[str], cwd: Path, nprocs: int = 2, timeout_s: float = 200.0,
              env: dict[str, str] | None = None) -> Ranks:
    """`torchrun --nproc-per-node NPROCS -m octopipe.cli WORDS` in CWD, as its ranks see it. The
    return code is 0 when every rank ended with 0, else the first failing rank's (torchrun says 1)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = dict(os.environ if env is None else env, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    ranks = [dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                  GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
             for rank in range(nprocs)]
    with tempfile.TemporaryDirectory(prefix="octopipe-ranks-") as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        out.touch()
        err.touch()
        server = _started_server()
        assert server.stdin is not None
        server.stdin.write(json.dumps({"ranks": ranks, "words": words, "cwd": str(cwd), "stdout": str(out),
                                       "stderr": str(err)}) + "\n")
        server.stdin.flush()
        pids = _line(server, 60.0)["pids"]
        try:
            codes = _line(server, timeout_s)["codes"]
        except TimeoutError:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            _line(server, 30.0)
            raise subprocess.TimeoutExpired(["torchrun ranks", *words], timeout_s, out.read_text(),
                                            err.read_text()) from None
        failed = [code for code in codes if code != 0]
        return Ranks(failed[0] if failed else 0, out.read_text(), err.read_text(), codes)


if __name__ == "__main__":
    _serve()
