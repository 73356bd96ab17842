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
from dataclasses import dataclass, field, fields
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


REPLICA_DRAFTERS = ("none", "ngram", "specformer", "draft-model")  # drafters a verifier replica runs itself
SERVICE_DRAFTERS = ("ngram", "draft-model")  # drafters that also run as a drafter service


@dataclass
class StackConfig:
    """What to start.

    Attributes:
        model: target model (GGUF / HF directory); None = bundled SmolLM2-135M-Instruct.
        drafter: "none", "ngram", "specformer" or "draft-model".
        draft_model: weights for specformer / draft-model: a path (or truncate:N for a draft model).
        drafter_service: run the drafter as a drafter service the replicas call (``tandem serve
            drafter``); None: for "draft-model" only (a model of its own, on a cheaper GPU), the
            others run inside the replicas (SpecFormer in the verify pass, n-gram on the CPU).
        num_draft_tokens: k.
        max_batch_size: KV slots per verifier replica (requests decoding at once).
        max_seq_len: context limit per request.
        api_key: bearer token required by every service (None: none).
        redis_url: the replicas' shared state store (None: in-memory in each replica).
        grpc_front_door: also serve ``tandem.v1.Router`` on a port.
        drafter_timeout_s: a replica's wait for one round from the drafter service (s).
        verifier_timeout_s: the router's keepalive deadline for a hung replica (s).
        failover_wait_s: how long a request waits for a replica when all have failed (s).
        log_dir: where each process's log goes; default: a temporary directory that
            ``Stack.stop`` removes (kept only when the stack fails to start: the error names it).
        num_verifiers: verifier replicas (processes).
        overlap: replicas ask the drafter service for the next round while the target verifies.
        policy: draft-length policy: "fixed", "entropy" or "predictor" (with ``predictor``).
        predictor: acceptance predictor file for ``policy="predictor"``.
        measure_cost: adaptive policies allocate draft tokens under T(b, q) timed at start-up.
        trace_dir: each process exports its spans as OTLP JSON to ``trace_dir/<name>.jsonl``
            (``TANDEM_TRACE_FILE``; read them with ``tandem trace-report``); None: as the
            environment says.
        replica_options: more ``tandem serve verifier`` options, e.g. runner settings
            (``--device cuda``, ``--kernels fused``, ``--no-compile``).
    """

    model: str | None = None
    drafter: str = "ngram"
    draft_model: str | None = None
    drafter_service: bool | None = None
    num_draft_tokens: int = 4
    max_batch_size: int = 8
    max_seq_len: int = 2048
    api_key: str | None = None
    redis_url: str | None = None
    grpc_front_door: bool = True
    drafter_timeout_s: float = 10.0
    verifier_timeout_s: float = 10.0
    failover_wait_s: float = 30.0
    log_dir: str | None = None
    num_verifiers: int = 1
    overlap: bool = True
    policy: str = "fixed"
    predictor: str | None = None
    measure_cost: bool = False
    trace_dir: str | None = None
    replica_options: tuple[str, ...] = ()

    @classmethod
    def serving(cls, spec: SpeculativeConfig, **settings) -> "StackConfig":
        """The stack that serves ``spec``: its drafter, k and draft policy in the verifier
        replicas (the drafter behind a drafter service as ``drafter_service`` says);
        ``settings`` are the other fields.

        Raises:
            ConfigError: a configuration the services cannot run (``speculation``).
        """
        config = cls(drafter=spec.drafter, draft_model=spec.draft_model, num_draft_tokens=spec.num_draft_tokens,
                     policy=spec.policy, predictor=spec.predictor, **settings)
        if config.speculation != spec:
            raise ConfigError("verifier replicas learn the acceptance threshold online and take no branching or "
                              f"host-round settings; this configuration cannot be served: {spec}")
        return config

    @property
    def uses_drafter_service(self) -> bool:
        """Whether the drafter runs as a service of its own (see ``drafter_service``)."""
        if self.drafter == "none":
            return False
        return self.drafter == "draft-model" if self.drafter_service is None else self.drafter_service

    @property
    def speculation(self) -> SpeculativeConfig:
        """How the stack speculates: the drafter, k and the replicas' policy.

        Raises:
            ConfigError: an unknown drafter, a drafter service for a drafter that has none
                (SpecFormer drafts inside the verify pass), or a bad policy / predictor combination.
        """
        if self.drafter not in REPLICA_DRAFTERS:
            raise ConfigError(f"the service stack runs drafters {', '.join(REPLICA_DRAFTERS)}, not {self.drafter!r}")
        if self.uses_drafter_service and self.drafter not in SERVICE_DRAFTERS:
            raise ConfigError(f"the {self.drafter} drafter has no drafter service (it drafts inside the verifier "
                              f"replica); drafter services run {', '.join(SERVICE_DRAFTERS)}")
        return SpeculativeConfig(self.drafter, draft_model=self.draft_model, num_draft_tokens=self.num_draft_tokens,
                                 policy=self.policy, predictor=self.predictor)


@dataclass(frozen=True)
class ReplicaCounters:
    """Totals since start over verifier replicas (``LoadReport``): CUDA graphs captured, engine
    steps run, seconds inside them, seconds after them handing their events to the streams,
    decode rounds and their rows, prefills and their host seconds."""

    graphs_captured: int = 0
    engine_steps: int = 0
    engine_step_s: float = 0.0
    engine_deliver_s: float = 0.0
    engine_rounds: int = 0
    engine_round_rows: int = 0
    engine_prefills: int = 0
    engine_prefill_s: float = 0.0

    def __add__(self, o: "ReplicaCounters") -> "ReplicaCounters":
        return ReplicaCounters(*(getattr(self, f.name) + getattr(o, f.name) for f in fields(self)))

    def __sub__(self, o: "ReplicaCounters") -> "ReplicaCounters":
        return ReplicaCounters(*(getattr(self, f.name) - getattr(o, f.name) for f in fields(self)))


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

    def replica_counters(self, timeout_s: float = 30.0) -> "ReplicaCounters":
        """Totals since start over the stack's verifier replicas, from their ``Load`` reports."""
        from services.common import auth_metadata
        from services.proto.tandem.v1 import verifier_pb2, verifier_pb2_grpc

        total = ReplicaCounters()
        for address in self.verifier_addresses:
            with grpc.insecure_channel(address) as channel:
                r = verifier_pb2_grpc.VerifierStub(channel).Load(
                    verifier_pb2.LoadRequest(), timeout=timeout_s, metadata=auth_metadata(self.config.api_key))
            total = total + ReplicaCounters(*(getattr(r, f.name) for f in fields(ReplicaCounters)))
        return total

    def graphs_captured(self, timeout_s: float = 30.0) -> int:
        """CUDA graphs the stack's verifier replicas have captured since they started (0 without
        CUDA graphs): a pass that raises it met shapes for the first time, and its captures were
        timed with it."""
        return self.replica_counters(timeout_s).graphs_captured

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, s) each of the stack's processes has used since it started,
        by name (``router``, ``verifier`` or ``verifier<i>``, ``drafter``; threads included); a
        process gone reads 0."""
        import psutil

        out = {}
        for name, proc in sorted(self.processes.items()):
            try:
                t = psutil.Process(proc.pid).cpu_times()
                out[name] = t.user + t.system
            except psutil.Error:
                out[name] = 0.0
        return out

    def stop(self, timeout_s: float = 15.0, keep_logs: bool = False) -> None:
        """SIGTERM each process, routers first, then the replicas, then the drafter, each tier
        waited for before the next (SIGKILL for what is still alive ``timeout_s`` after the
        start); then remove the temporary log directory unless
        ``keep_logs``."""
        names = sorted(self.processes)
        deadline = time.monotonic() + timeout_s
        # tier by tier, each gone before the next is signalled: a router never sees its replicas
        # vanish under it (no "does not answer" at an orderly stop), a replica never its drafter
        for tier in ([n for n in names if n.startswith("router")], [n for n in names if n.startswith("verifier")],
                     [n for n in names if n == "drafter"]):
            procs = [self.processes[n] for n in tier]
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.temp_log_dir is not None and not keep_logs:
            shutil.rmtree(self.temp_log_dir, ignore_errors=True)
            self.temp_log_dir = None

    _args: dict[str, list[str]] = field(default_factory=dict)  # each process's `tandem serve` arguments

    def restart(self, name: str, timeout_s: float = 120.0) -> None:
        """Start process ``name`` ("drafter", "verifier", "verifier1", "router", ...) again with
        its old arguments and port (after a crash or a kill), and wait until it is healthy.

        Raises:
            RuntimeError: it died during start-up; TimeoutError: not healthy in time.
        """
        old = self.processes.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"{name} is still running (pid {old.pid})")
        self.processes[name] = self.spawn(name, self._args[name])
        self._wait(name, timeout_s)

    def add_router(self, name: str, timeout_s: float = 120.0) -> str:
        """Start one more router process over the same replicas (as router autoscaling does), on
        ports of its own; returns its HTTP URL."""
        hport, gport = free_port(), free_port()
        args = _replace_flag(_replace_flag(self._args["router"], "--port", str(hport)), "--grpc-port", str(gport))
        self._args[name] = args
        self.logs[name] = self.logs["router"].with_name(f"{name}.log")
        self.processes[name] = self.spawn(name, args)
        self._wait(name, timeout_s)
        return _router_url(args)

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        """``tandem serve <kind of name> args`` as process ``name``, logging to ``logs[name]``."""
        kind = name.rstrip("0123456789")
        return _spawn(kind, args, self.logs[name], self.config.api_key, _trace_file(self.config, name))

    def _wait(self, name: str, timeout_s: float) -> None:
        if name.startswith("router"):
            wait_http_healthy(_router_url(self._args[name]), timeout_s, self.processes[name], self.logs[name])
        else:
            wait_grpc_healthy(f"127.0.0.1:{_flag(self._args[name], '--port')}", timeout_s, self.processes[name],
                              self.logs[name])


def _flag(args: list[str], flag: str) -> str:
    """The value after ``flag`` in ``args``."""
    return args[args.index(flag) + 1]


def _router_url(args: list[str]) -> str:
    """The HTTP URL of a router started with ``args`` (its ``--port`` on loopback)."""
    return f"http://127.0.0.1:{_flag(args, '--port')}"


def _replace_flag(args: list[str], flag: str, value: str) -> list[str]:
    if flag not in args:
        return args
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


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
    """Spawn the drafter service (if the configuration has one), the verifier replicas and the
    router as ``tandem serve ...`` processes on free loopback ports and wait until all are healthy.

    Raises:
        ConfigError: a configuration the services cannot run (``StackConfig.speculation``).
        RuntimeError: a process died during start-up (its log tail is in the message).
        TimeoutError: not healthy within ``timeout_s``.
    """
    spec = config.speculation  # a configuration the services cannot run fails before any process starts
    log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="tandem-stack-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    vports = [free_port() for _ in range(config.num_verifiers)]
    dport, hport, gport = free_port(), free_port(), free_port()
    model = ["--model", config.model] if config.model else []
    vnames = ["verifier"] if config.num_verifiers == 1 else [f"verifier{i}" for i in range(config.num_verifiers)]
    stack = Stack(config, [f"127.0.0.1:{p}" for p in vports],
                  f"127.0.0.1:{dport}" if config.uses_drafter_service else None,
                  f"http://127.0.0.1:{hport}", f"127.0.0.1:{gport}" if config.grpc_front_door else None)
    stack.logs = {n: log_dir / f"{n}.log" for n in (*vnames, *(["drafter"] if stack.drafter_address else []), "router")}
    stack.temp_log_dir = None if config.log_dir else log_dir
    try:
        if stack.drafter_address:
            stack._args["drafter"] = ["--port", str(dport), "--drafter", spec.drafter,
                                      "--max-sequences", str(config.max_batch_size * config.num_verifiers),
                                      "--max-seq-len", str(config.max_seq_len), *model,
                                      *(["--draft-model", config.draft_model] if config.draft_model else [])]
            stack.processes["drafter"] = stack.spawn("drafter", stack._args["drafter"])
        replica = ["--max-batch-size", str(config.max_batch_size), "--max-seq-len", str(config.max_seq_len), *model,
                   "--num-draft-tokens", str(config.num_draft_tokens), "--policy", config.policy,
                   "--measure-cost" if config.measure_cost else "--no-measure-cost",
                   "--overlap" if config.overlap else "--no-overlap",
                   "--drafter-timeout", str(config.drafter_timeout_s),
                   *(["--predictor", config.predictor] if config.predictor else []),
                   *(["--redis-url", config.redis_url] if config.redis_url else []), *config.replica_options]
        if stack.drafter_address:
            replica += ["--drafter-address", stack.drafter_address]
        else:
            replica += ["--drafter", spec.drafter, *(["--draft-model", config.draft_model] if config.draft_model else [])]
        for name, port in zip(vnames, vports):
            stack._args[name] = ["--port", str(port), *replica]
            stack.processes[name] = stack.spawn(name, stack._args[name])
        for name in ([*vnames, "drafter"] if stack.drafter_address else vnames):
            stack._wait(name, timeout_s)
        router_args = ["--port", str(hport), "--verifier-timeout", str(config.verifier_timeout_s),
                       "--failover-wait", str(config.failover_wait_s), *model]
        for address in stack.verifier_addresses:
            router_args += ["--verifier", address]
        if stack.grpc_address:
            router_args += ["--grpc-port", str(gport)]
        stack._args["router"] = router_args
        stack.processes["router"] = stack.spawn("router", router_args)
        stack._wait("router", timeout_s)
    except BaseException:
        stack.stop(keep_logs=True)  # the error names a log: it stays
        raise
    return stack
