"""A throwaway local redis-server on a free loopback port (no persistence).

Used by `flashpd serve` when no `--redis` address is given, and by the tests:

    with LocalRedis() as redis_server:
        client = redis.asyncio.Redis.from_url(redis_server.url)

Fault injection (the fault suite, tests): `pause()` / `resume()` (SIGSTOP / SIGCONT), `kill()`
(SIGKILL, data gone) and `restart()` (a fresh empty server on the same port).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import redis

LOOPBACK = "127.0.0.1"
# Ports handed out lie between Ray's worker ports (10002-19999 by default) and the kernel's
# ephemeral range (32768-60999 on Linux by default, 49152-65535 elsewhere): a port picked here is
# not taken by a Ray worker or an outgoing connection between the pick and the server's bind.
# (An ephemeral pick was: the AgentX dry run's Serve gRPC port, chosen seconds before Ray came
# up, failed "Failed to bind to address 127.0.0.1:40193" once in CI.)
PORT_RANGE = (20000, 32768)
_handed: set[int] = set()  # never the same port twice from one process
_rng = random.Random(os.urandom(8))


def free_port(host: str = LOOPBACK) -> int:
    """A port of PORT_RANGE that binds now on `host` (one the kernel picks if none does)."""
    for _ in range(256):
        port = _rng.randrange(*PORT_RANGE)
        if port not in _handed and _binds(host, port):
            _handed.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class LocalRedis:
    def __init__(self, *, executable: str = "redis-server", start_timeout_s: float = 10.0, attempts: int = 3) -> None:
        path = shutil.which(executable)
        if path is None:
            raise FileNotFoundError(f"{executable} not found on PATH")
        self._executable, self._timeout_s, self._attempts = path, start_timeout_s, attempts
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("redis-server is not running")
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, port: int | None = None) -> LocalRedis:
        """Start on `port`, or on a free port (retried on a new one if another process grabbed
        it first)."""
        last_error = ""
        for _ in range(self._attempts):
            chosen = port or free_port()
            log_file = tempfile.TemporaryFile(mode="w+")  # a pipe could fill up and stall redis
            proc = subprocess.Popen(
                _server_command(self._executable, chosen), stdout=log_file, stderr=subprocess.STDOUT
            )
            if self._wait_ready(proc, chosen):
                self._proc, self._log_file, self.port = proc, log_file, chosen
                return self
            last_error = _stop_process(proc, log_file)
            if port is not None:
                time.sleep(0.2)  # the old server's socket may still be closing
        raise RuntimeError(f"redis-server did not start after {self._attempts} tries: {last_error}")

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing answers."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the server and its data are gone; `restart()` brings an empty one back."""
        self._signal(signal.SIGKILL)
        assert self._proc is not None
        self._proc.wait()

    def restart(self) -> LocalRedis:
        """A fresh, empty server on the same port (after `kill()`, or in place of this one)."""
        port = self.port
        if port is None:
            raise RuntimeError("redis-server was never started")
        if self._proc is not None and self._proc.poll() is None:
            self._signal(signal.SIGCONT)
            _stop_process(self._proc, self._log_file)
        elif self._log_file is not None:
            self._log_file.close()
        self._proc, self._log_file = None, None
        return self.start(port)

    def _signal(self, sig: int) -> None:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError("redis-server is not running")
        os.kill(self._proc.pid, sig)

    def stop(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                os.kill(self._proc.pid, signal.SIGCONT)  # a paused server cannot terminate
            _stop_process(self._proc, self._log_file)
        self._proc, self._log_file, self.port = None, None, None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self, proc: subprocess.Popen, port: int) -> bool:
        deadline = time.monotonic() + self._timeout_s
        client = redis.Redis(host=LOOPBACK, port=port, socket_connect_timeout=0.2)
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.02)
            return False
        finally:
            client.close()


def _stop_process(proc: subprocess.Popen, log_file) -> str:
    """Terminate (then kill) the process; return the tail of what it printed."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log_file.seek(0)
    output = log_file.read()
    log_file.close()
    return output[-2000:]


def _server_command(executable: str, port: int) -> list[str]:
    """redis-server on loopback only, with nothing persisted (the index is rebuilt by the workers)."""
    persistence = ["--save", "", "--appendonly", "no"]
    return [executable, "--port", str(port), "--bind", LOOPBACK, *persistence, "--protected-mode", "yes"]
