"""Local placement: shards forked by the launcher, and what happens when the launcher fails.

Real processes and real pipes throughout: the launcher is forked from the test process before
any event loop runs (as the coordinator does), or started as `python -m shardrun._launcher` (or,
for the failure paths, a stand-in script speaking its report lines); a shard that gets no config
exits by itself when its stdin closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from shardrun import launch, placement, protocol
from shardrun._tls import ca_store_deferred
from shardrun.launch import ForkedProcess, start_forked_shards

GUARD_S = 60.0  # hang guard only


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    logs = tmp_path / "logs"
    logs.mkdir()
    return logs, tmp_path


async def _end_without_config(shard: placement.LocalShard) -> str | None:
    """Close the shard's stdin before any config: it exits with status 2 on its own."""
    assert hasattr(shard.stdin, "close")
    shard.stdin.close()
    return await asyncio.wait_for(shard.wait(), GUARD_S)


def test_a_spawned_shard_that_ended_leaves_no_descriptor_behind(tmp_path: Path) -> None:
    """Under uvloop (the coordinator's loop) a pipe transport does not close when the process
    at its other end ends: five spawned shards, killed and waited for, leave as many open
    descriptors in this process as there were before them."""
    import uvloop

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    kept: list[placement.LocalShard] = []  # as the coordinator keeps every handle to the end

    async def one(logs: Path, out: Path, index: int) -> None:
        shard = await placement.start_local_shard(index, logs, out, 0)
        kept.append(shard)
        shard.kill()
        # Its stdout read to the end first, then its end waited for, as the coordinator does:
        # `wait` closes our ends of its pipes, and a read after that waited for good (a rare
        # hang of this test in CI).
        while await asyncio.wait_for(shard.receive(), GUARD_S) is not None:
            pass
        assert await asyncio.wait_for(shard.wait(), GUARD_S) == "killed by signal SIGKILL"

    async def main() -> tuple[int, int]:
        logs, out = _dirs(tmp_path)
        await one(logs, out, 0)  # the loop opens what it keeps for good (/dev/null) once
        await asyncio.sleep(0.05)
        gc.collect()
        before = open_fds()
        for index in range(1, 6):
            await one(logs, out, index)
        await asyncio.sleep(0.05)  # the loop closes what it was told to close
        gc.collect()
        return before, open_fds()

    before, after = uvloop.run(main())
    assert after == before


def test_forked_shards_speak_the_protocol_and_report_their_exit(tmp_path: Path) -> None:
    async def main() -> None:
        logs, out = _dirs(tmp_path)
        shards, launcher = await start_forked_shards([0, 1], logs, out, 0)
        assert all(isinstance(s.proc, ForkedProcess) for s in shards)
        assert len({s.pid for s in shards}) == 2 and os.getpid() not in {s.pid for s in shards}
        # Shard 0 gets a message it cannot take as its first: it says so on stderr, exits 2.
        shards[0].send({"t": protocol.END})
        assert await asyncio.wait_for(shards[0].wait(), GUARD_S) == "exited with status 2"
        assert "expected a config message first" in (logs / "shard-00.log").read_text()
        # Shard 1 is killed: the launcher reaps it and reports the signal.
        shards[1].kill()
        assert await asyncio.wait_for(shards[1].wait(), GUARD_S) == "killed by signal SIGKILL"
        await asyncio.wait_for(launcher.close(), GUARD_S)
        assert launcher.proc.returncode == 0

    asyncio.run(main())


async def _orphan(tmp_path: Path) -> placement.LocalShard:
    """One forked shard, waiting for its config, whose launcher was killed."""
    logs, out = _dirs(tmp_path)
    (shard,), launcher = await start_forked_shards([0], logs, out, 0)
    os.kill(launcher.proc.pid, signal.SIGKILL)
    await asyncio.wait_for(launcher.close(), GUARD_S)
    return shard


def test_a_shard_outlives_a_killed_launcher_and_ends_with_an_unknown_status(
        tmp_path: Path) -> None:
    async def main() -> None:
        shard = await _orphan(tmp_path)
        why = await _end_without_config(shard)
        assert why == "ended with an unknown status: the shard launcher is gone"

    asyncio.run(main())


def test_kill_still_reaches_a_shard_whose_launcher_is_gone(tmp_path: Path) -> None:
    """The coordinator's last resort (kill) works on an orphaned shard: its pipes close."""
    async def main() -> None:
        shard = await _orphan(tmp_path)
        shard.kill()  # it waits for a config that never comes: only the kill ends it
        assert await asyncio.wait_for(shard.stdout.read(), GUARD_S) == b""  # EOF: it is gone
        assert shard.stdout.at_eof()
        shard.kill()  # and now does nothing (its PID is no longer ours to signal)

    asyncio.run(main())


def test_a_shard_the_launcher_could_not_fork_is_spawned(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str],
                                                        ) -> None:
    """A launcher that forks shard 1 only: shard 0 starts as a fresh interpreter instead."""
    stand_in = tmp_path / "launcher.py"
    stand_in.write_text(
        "import os, sys\n"
        "slots = [a.split(':') for a in sys.argv[1:]]\n"
        "print('fail 0 no memory to fork', flush=True)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    index, stdin, stdout, stderr = map(int, slots[1])\n"
        "    os.dup2(stdin, 0); os.dup2(stdout, 1)\n"
        "    os.execv(sys.executable, [sys.executable, '-m', 'shardrun._shard_main'])\n"
        "print(f'pid 1 {pid}', flush=True)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(f'exit 1 {os.waitstatus_to_exitcode(status)}', flush=True)\n"
    )
    monkeypatch.setattr(launch, "LAUNCHER_ARGV", (sys.executable, str(stand_in)))

    async def main() -> None:
        logs, out = _dirs(tmp_path)
        shards, launcher = await start_forked_shards([0, 1], logs, out, 0)
        assert not isinstance(shards[0].proc, ForkedProcess)  # spawned
        assert isinstance(shards[1].proc, ForkedProcess)
        for shard in shards:
            assert await _end_without_config(shard) == "exited with status 2"
        await asyncio.wait_for(launcher.close(), GUARD_S)

    asyncio.run(main())
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"warning: the shard launcher did not fork shard 0 (see "
                        f"{tmp_path / 'logs' / 'launcher.log'}); it starts as a fresh "
                        "interpreter"]


# -- the launcher forked from this process, before any event loop ------------------------------

LINUX_PROC = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc (Linux)")


def _python(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run `code` in an interpreter of its own (to fork from, or to limit); return its stdout."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=GUARD_S, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def one_thread() -> None:
    """`fork_launcher` declines beside another thread, and an earlier test's asyncio child
    watcher thread (one per subprocess, on plain asyncio) may still be on its way out."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            thread.join(GUARD_S)
    assert threading.active_count() == 1


def _fds_of(pid: int) -> dict[int, str]:
    """A process's open descriptors and what each points at (Linux /proc)."""
    fds = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile (our listing's own)
            fds[int(fd.name)] = os.readlink(fd)
    return fds


def _run_prepared(prepared: launch.PreparedLaunch, out: Path,
                  check: Callable[[list[placement.LocalShard], launch.Launcher], None],
                  ) -> None:
    """Start a prepared launch in a loop, run `check`, then end both shards and the launcher."""
    async def main() -> None:
        shards, launcher = await prepared.start(out)
        try:
            check(shards, launcher)
        except BaseException:  # no process outlives a failed check
            for shard in shards:
                shard.kill()
            launcher.kill()
            await asyncio.wait_for(launcher.close(), GUARD_S)
            raise
        for shard in shards:
            assert await _end_without_config(shard) == "exited with status 2"
        await asyncio.wait_for(launcher.close(), GUARD_S)
        assert launcher.proc.returncode == 0

    asyncio.run(main())


def test_a_launcher_forked_before_the_loop_forks_the_shards(tmp_path: Path,
                                                            one_thread: None) -> None:
    logs, out = _dirs(tmp_path)
    prepared = launch.fork_launcher([0, 1], logs, 0, tls=False)
    assert prepared is not None
    launcher_pid = prepared.process.pid

    def check(shards: list[placement.LocalShard], launcher: launch.Launcher) -> None:
        assert launcher.proc.pid == launcher_pid != os.getpid()
        assert all(isinstance(s.proc, ForkedProcess) for s in shards)
        for shard in shards:  # children of the launcher, not of this process
            assert psutil.Process(shard.pid).ppid() == launcher_pid

    _run_prepared(prepared, out, check)
    assert "expected a config message first" in (logs / "shard-01.log").read_text()


@LINUX_PROC
def test_the_forked_launcher_keeps_none_of_our_descriptors(tmp_path: Path,
                                                           one_thread: None) -> None:
    """Whatever this process had open (a run's lock, its event log, a simulator's pipes) is
    closed in the launcher and so in every shard: a copy of a pipe would hide its end, a copy
    of the lock would outlive the coordinator."""
    logs, out = _dirs(tmp_path)
    ours = open(tmp_path / "held.lock", "ab")  # noqa: SIM115
    pipe_r, pipe_w = os.pipe()
    try:
        prepared = launch.fork_launcher([0, 1], logs, 0, tls=False)
        assert prepared is not None

        def check(shards: list[placement.LocalShard], launcher: launch.Launcher) -> None:
            deadline = time.monotonic() + GUARD_S
            # It closes the slots once every shard is forked, just after reporting the last.
            while set(held := _fds_of(launcher.proc.pid)) != {0, 1, 2} and (
                    time.monotonic() < deadline):
                time.sleep(0.01)
            assert set(held) == {0, 1, 2}, held  # every slot was handed to its shard
            assert held[0] == os.devnull and held[1].startswith("pipe:")
            assert held[2] == str(logs / "launcher.log")
            mine = {link for fd, link in _fds_of(os.getpid()).items()
                    if fd in (ours.fileno(), pipe_r, pipe_w)}
            for shard in shards:
                theirs = set(_fds_of(shard.pid).values())
                assert not theirs & mine, theirs & mine

        _run_prepared(prepared, out, check)
    finally:
        ours.close()
        os.close(pipe_r)
        os.close(pipe_w)


def test_no_launcher_is_forked_beside_another_thread_or_in_a_running_loop(
        tmp_path: Path, one_thread: None) -> None:
    logs, _ = _dirs(tmp_path)
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert launch.fork_launcher([0], logs, 0, tls=False) is None
    finally:
        release.set()
        other.join()

    async def in_a_loop() -> launch.PreparedLaunch | None:
        return launch.fork_launcher([0], logs, 0, tls=False)

    assert asyncio.run(in_a_loop()) is None
    assert not list(logs.iterdir())  # nothing was even opened


def test_a_launch_that_never_starts_leaves_no_process(tmp_path: Path, one_thread: None,
                                                      no_stray_children: None) -> None:
    logs, _ = _dirs(tmp_path)
    prepared = launch.fork_launcher([0, 1], logs, 0, tls=False)
    assert prepared is not None
    prepared.abandon()
    assert prepared.process.returncode == 0  # its shards saw EOF and ended; so did it
    assert "expected a config message first" in (logs / "shard-00.log").read_text()


# -- the CA store -------------------------------------------------------------------------------

TEST_CA = Path(__file__).parent / "data" / "test-ca.pem"  # one self-signed CA certificate


def test_a_deferred_ca_store_is_skipped_then_loaded_on_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(TEST_CA))
    loaded = ssl.create_default_context().cert_store_stats()["x509_ca"]
    assert loaded >= 1
    with ca_store_deferred() as skipped:
        context = ssl.create_default_context()
    assert skipped == [context]
    assert context.cert_store_stats()["x509_ca"] == 0  # verifies no server at all
    context.set_default_verify_paths()
    assert context.cert_store_stats()["x509_ca"] == loaded
    assert "set_default_verify_paths" not in ssl.SSLContext.__dict__  # the patch is gone
    assert ssl.create_default_context().cert_store_stats()["x509_ca"] == loaded


@pytest.mark.parametrize("tls", [True, False])
def test_the_launcher_loads_the_ca_store_only_for_tls(tls: bool) -> None:
    """aiohttp loads the store into its default contexts at import; a launcher for a plain
    http endpoint skips that, one for https does not."""
    code = ("from shardrun._launcher import import_shard\n"
            f"import_shard(tls={tls})\n"
            "from aiohttp import connector\n"
            "print(connector._SSL_CONTEXT_VERIFIED.cert_store_stats()['x509_ca'])\n")
    out = _python(code, env={**os.environ, "SSL_CERT_FILE": str(TEST_CA)})
    assert int(out) == (1 if tls else 0)


@LINUX_PROC
def test_with_stdin_closed_no_shard_pipe_lands_on_fd_0(tmp_path: Path) -> None:
    """With fd 0 closed, the next pipe would be fd 0, and the launcher's /dev/null on fd 0 would
    replace a shard's stdin: the hole is filled first, and the shard reads its own pipe."""
    logs, _ = _dirs(tmp_path)
    code = ("import asyncio, os, sys, time\n"
            "os.close(0)\n"
            "from pathlib import Path\n"
            "from shardrun import launch\n"
            "prepared = launch.fork_launcher([0], Path(sys.argv[1]), 0, tls=False)\n"
            "async def main():\n"
            "    (shard,), launcher = await prepared.start(Path(sys.argv[1]))\n"
            "    link, deadline = '', time.monotonic() + 30\n"
            "    while time.monotonic() < deadline:  # until the shard has moved its pipes\n"
            "        try:\n"
            "            link = os.readlink(f'/proc/{shard.pid}/fd/0')\n"
            "        except FileNotFoundError:  # it is gone (read EOF, exited)\n"
            "            break\n"
            "        if link.startswith('pipe:'):\n"
            "            break\n"
            "        time.sleep(0.01)\n"
            "    print(link, flush=True)\n"
            "    shard.kill()\n"
            "    await launcher.close()\n"
            "asyncio.run(main())\n")
    out = _python(code, str(logs))
    assert out.startswith("pipe:"), out


# Fails at the first shard's second pipe, the second shard's second pipe, the launcher's own
# descriptors (one more is free than `spare`: the one that listed /proc/self/fd).
@LINUX_PROC
@pytest.mark.parametrize("spare", [1, 6, 11])
def test_out_of_descriptors_no_launcher_is_forked_and_none_leak(tmp_path: Path,
                                                                 spare: int) -> None:
    """Two slots need ten descriptors and the launcher three more: with fewer left, there is
    no fork (the coordinator's loop then tries the other way and reports the error), and
    every descriptor made on the way is closed again."""
    logs, _ = _dirs(tmp_path)
    code = ("import os, resource, sys\n"
            "from pathlib import Path\n"
            "from shardrun import launch\n"
            "before = sorted(os.listdir('/proc/self/fd'))\n"
            "used = {int(fd) for fd in before}\n"
            "limit, free = 0, 0\n"  # the limit below which exactly `spare` fds are free
            f"while free < {spare}:\n"
            "    free += limit not in used\n"
            "    limit += 1\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))\n"
            "print(launch.fork_launcher([0, 1], Path(sys.argv[1]), 0, tls=False))\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))\n"
            "print(sorted(os.listdir('/proc/self/fd')) == before)\n")
    out = _python(code, str(logs))
    assert out.split() == ["None", "True"], out


def test_the_simulator_process_loads_no_ca_store() -> None:
    """`python -m shardrun.sim` (how a run starts its simulator) serves plain HTTP only."""
    code = ("import runpy, sys\n"
            "sys.argv = ['shardrun.sim', '--help']\n"
            "try:\n"
            "    runpy.run_module('shardrun.sim', run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "from aiohttp import connector\n"
            "print('loaded', connector._SSL_CONTEXT_VERIFIED.cert_store_stats()['x509_ca'])\n")
    out = _python(code, env={**os.environ, "SSL_CERT_FILE": str(TEST_CA)})
    assert out.splitlines()[-1] == "loaded 0", out[-300:]
