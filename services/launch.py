"""Start the disaggregated stack locally (verifier, drafter, router as separate processes on
loopback), wait until each is healthy, and stop it cleanly: what ``tandem demo`` / ``make run``
and the end-to-end tests use.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.errors import ConfigError
from tandem.speculation import SpeculativeConfig


def free_port() -> int:
    """A TCP port that is free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVICE_DRAFTERS = ("none", "ngram", "draft-model")  # SpecFormer drafts inside the verifier: no service


@dataclass
class StackConfig:
    """What to start.

    Attributes:
        model: target model (GGUF / HF directory); None = bundled SmolLM2-135M-Instruct.
        drafter: "ngram", "draft-model" or "none" (no drafter process).
        draft_model: for draft-model: a path or truncate:N.
        num_draft_tokens: k.
        max_batch_size: verifier KV slots (requests decoding at once).
        max_seq_len: context limit per request.
        api_key: bearer token required by every service (None: none).
        redis_url: shared state for the router (None: ``TANDEM_REDIS_URL`` or in-memory).
        grpc_front_door: also serve ``tandem.v1.Router`` on a port.
        drafter_timeout_s: router's wait for one round of drafts (s).
        verifier_timeout_s: router's wait for one verify batch before it fails its requests (s).
        log_dir: where each process's log goes; default: a temporary directory that
            ``Stack.stop`` removes (kept only when the stack fails to start: the error names it).
        num_verifiers: verifier replicas (processes); the router runs one engine per replica.
        overlap: the router drafts the next round while the verifier checks this one.
        policy: router draft-length policy: "fixed", "entropy" or "predictor" (with ``predictor``).
        predictor: acceptance predictor file for ``policy="predictor"``.
        measure_cost: verifiers measure T(b, q) for q <= K+1 at start-up (0: off); adaptive
            policies allocate draft tokens with it.
        trace_dir: each process exports its spans as OTLP JSON to ``trace_dir/<name>.jsonl``
            (``TANDEM_TRACE_FILE``; read them with ``tandem trace-report``); None: as the
            environment says.
    """

    model: str | None = None
    drafter: str = "ngram"
    draft_model: str | None = None
    num_draft_tokens: int = 4
    max_batch_size: int = 8
    max_seq_len: int = 2048
    api_key: str | None = None
    redis_url: str | None = None
    grpc_front_door: bool = True
    drafter_timeout_s: float = 10.0
    verifier_timeout_s: float = 120.0
    log_dir: str | None = None
    num_verifiers: int = 1
    overlap: bool = True
    policy: str = "fixed"
    predictor: str | None = None
    measure_cost: int = 0
    trace_dir: str | None = None

    @classmethod
    def serving(cls, spec: SpeculativeConfig, **settings) -> "StackConfig":
        """The stack that serves ``spec``: its drafter as the drafter service, its k and draft
        policy in the router; ``settings`` are the other fields.

        Raises:
            ConfigError: a configuration the services cannot run (``speculation``).
        """
        config = cls(drafter=spec.drafter, draft_model=spec.draft_model, num_draft_tokens=spec.num_draft_tokens,
                     policy=spec.policy, predictor=spec.predictor, **settings)
        if config.speculation != spec:
            raise ConfigError("the router sets the acceptance threshold online and takes no branching or host-round settings; "
                              f"this configuration cannot be served: {spec}")
        return config

    @property
    def speculation(self) -> SpeculativeConfig:
        """How the stack speculates: the drafter service's kind, the router's k and policy.

        Raises:
            ConfigError: a drafter without a service (SpecFormer drafts inside the verifier's
                forward) or a bad policy / predictor combination.
        """
        if self.drafter not in SERVICE_DRAFTERS:
            raise ConfigError(f"the service stack runs drafters {', '.join(SERVICE_DRAFTERS)}, not {self.drafter!r}")
        return SpeculativeConfig(self.drafter, draft_model=self.draft_model, num_draft_tokens=self.num_draft_tokens,
                                 policy=self.policy, predictor=self.predictor)


@dataclass
class Stack:
    """A running stack: addresses, processes and their logs."""

    config: StackConfig
    verifier_addresses: list[str]
    drafter_address: str | None
    http_url: str
    grpc_address: str | None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    temp_log_dir: Path | None = None  # made by start_stack (no StackConfig.log_dir): removed by stop

    def stop(self, timeout_s: float = 15.0, keep_logs: bool = False) -> None:
        """SIGTERM each process (router first), then SIGKILL what is still alive after
        ``timeout_s``; then remove the temporary log directory unless ``keep_logs``."""
        for name in ["router", "drafter", *sorted(n for n in self.processes if n.startswith("verifier"))]:
            p = self.processes.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.processes.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.temp_log_dir is not None and not keep_logs:
            shutil.rmtree(self.temp_log_dir, ignore_errors=True)
            self.temp_log_dir = None

    def restart_drafter(self) -> None:
        """Start the drafter again on its old port (after a crash or a kill)."""
        self.processes["drafter"] = _spawn("drafter", self._drafter_args, self.logs["drafter"], self.config.api_key,
                                           _trace_file(self.config, "drafter"))
        wait_grpc_healthy(self.drafter_address, 120, self.processes["drafter"], self.logs["drafter"])

    _drafter_args: list[str] = field(default_factory=list)


def _spawn(name: str, args: list[str], log_path: Path, api_key: str | None,
           trace_file: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if trace_file is not None:
        env["TANDEM_TRACE_FILE"] = str(trace_file)
    if api_key:
        env["TANDEM_API_KEY"] = api_key
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = open(log_path, "ab")
    return subprocess.Popen([sys.executable, "-m", "tandem", "-v", "serve", name, *args], stdout=log,
                            stderr=subprocess.STDOUT, env=env, cwd=root)


def _trace_file(config: StackConfig, name: str) -> Path | None:
    if config.trace_dir is None:
        return None
    Path(config.trace_dir).mkdir(parents=True, exist_ok=True)
    return Path(config.trace_dir) / f"{name}.jsonl"


def _check_alive(proc: subprocess.Popen, log_path: Path | str, what: str) -> None:
    if proc.poll() is not None:
        tail = Path(log_path).read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{what} exited with status {proc.returncode} during start-up; log tail:\n{tail}")


def wait_grpc_healthy(address: str, timeout_s: float, proc: subprocess.Popen, log_path: Path) -> None:
    """Poll the standard gRPC health service until it says SERVING.

    Raises:
        RuntimeError: the process died; TimeoutError: not healthy in time.
    """
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            _check_alive(proc, log_path, address)
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not healthy after {timeout_s:.0f} s (log: {log_path})")


def wait_http_healthy(url: str, timeout_s: float, proc: subprocess.Popen, log_path: Path) -> None:
    """Poll ``url``/health until it answers 200."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _check_alive(proc, log_path, url)
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s (log: {log_path})")


def start_stack(config: StackConfig, timeout_s: float = 300.0) -> Stack:
    """Spawn verifier, drafter (unless "none") and router as ``tandem serve ...`` processes on free
    loopback ports and wait until all are healthy.

    Raises:
        ConfigError: a configuration the services cannot run (``StackConfig.speculation``).
        RuntimeError: a process died during start-up (its log tail is in the message).
        TimeoutError: not healthy within ``timeout_s``.
    """
    config.speculation  # a configuration the services cannot run fails before any process starts
    log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="tandem-stack-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    vports = [free_port() for _ in range(config.num_verifiers)]
    dport, hport, gport = free_port(), free_port(), free_port()
    model = ["--model", config.model] if config.model else []
    vnames = ["verifier"] if config.num_verifiers == 1 else [f"verifier{i}" for i in range(config.num_verifiers)]
    stack = Stack(config, [f"127.0.0.1:{p}" for p in vports],
                  f"127.0.0.1:{dport}" if config.drafter != "none" else None,
                  f"http://127.0.0.1:{hport}", f"127.0.0.1:{gport}" if config.grpc_front_door else None)
    stack.logs = {n: log_dir / f"{n}.log" for n in (*vnames, "drafter", "router")}
    stack.temp_log_dir = None if config.log_dir else log_dir
    try:
        for name, port in zip(vnames, vports):
            stack.processes[name] = _spawn("verifier", [
                "--port", str(port), "--max-batch-size", str(config.max_batch_size), "--max-seq-len",
                str(config.max_seq_len), "--measure-cost", str(config.measure_cost), *model], stack.logs[name],
                config.api_key, _trace_file(config, name))
        if stack.drafter_address:
            stack._drafter_args = ["--port", str(dport), "--drafter", config.drafter,
                                   "--max-sequences", str(config.max_batch_size * config.num_verifiers),
                                   "--max-seq-len", str(config.max_seq_len), *model,
                                   *(["--draft-model", config.draft_model] if config.draft_model else [])]
            stack.processes["drafter"] = _spawn("drafter", stack._drafter_args, stack.logs["drafter"], config.api_key,
                                                _trace_file(config, "drafter"))
        for name, address in zip(vnames, stack.verifier_addresses):
            wait_grpc_healthy(address, timeout_s, stack.processes[name], stack.logs[name])
        if stack.drafter_address:
            wait_grpc_healthy(stack.drafter_address, timeout_s, stack.processes["drafter"], stack.logs["drafter"])
        router_args = ["--port", str(hport), "--num-draft-tokens", str(config.num_draft_tokens),
                       "--drafter-timeout", str(config.drafter_timeout_s),
                       "--verifier-timeout", str(config.verifier_timeout_s), *model,
                       "--overlap" if config.overlap else "--no-overlap", "--policy", config.policy,
                       *(["--predictor", config.predictor] if config.predictor else [])]
        for address in stack.verifier_addresses:
            router_args += ["--verifier", address]
        if stack.drafter_address:
            router_args += ["--drafter", stack.drafter_address]
        if stack.grpc_address:
            router_args += ["--grpc-port", str(gport)]
        if config.redis_url:
            router_args += ["--redis-url", config.redis_url]
        stack.processes["router"] = _spawn("router", router_args, stack.logs["router"], config.api_key,
                                           _trace_file(config, "router"))
        wait_http_healthy(stack.http_url, timeout_s, stack.processes["router"], stack.logs["router"])
    except BaseException:
        stack.stop(keep_logs=True)  # the error names a log: it stays
        raise
    return stack
