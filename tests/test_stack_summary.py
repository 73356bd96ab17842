"""scripts/stack_summary.py: py-spy's raw stacks summarised per process and thread."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _module():
    path = Path(__file__).resolve().parent.parent / "scripts" / "stack_summary.py"
    spec = importlib.util.spec_from_file_location("stack_summary", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stacks_are_counted_per_process_and_thread_with_inclusive_focus(tmp_path):
    """Samples split by the process (its command, or its pid when py-spy could not read it) and
    the thread; a function counts once per stack however deep it recurs; focus names match the
    ``Class.method`` part of a frame; lines that are not stacks are skipped."""
    bench = 'process 10:""'
    replica = 'process 11:"/usr/bin/python3 -m tandem -v serve verifier --port 1"'
    raw = "\n".join([
        f"{bench};{replica};thread (21): replica-engine;Thread.run (threading.py:982);"
        "ReplicaEngine._run (services/verifier/replica.py:206);Engine.step (tandem/engine.py:349) 7",
        f"{bench};{replica};thread (21): replica-engine;Thread.run (threading.py:982);"
        "ReplicaEngine._run (services/verifier/replica.py:206);VerifierServicer._events (server.py:230) 3",
        f"{bench};{replica};thread (20): MainThread;BaseEventLoop._run_once (base_events.py:1);"
        "f (a.py:1);f (a.py:1) 5",
        f"{bench};thread (30): MainThread;generate_all (services/router/client.py:60) 4",
        "py-spy> not a stack line",
        "",
    ])
    path = tmp_path / "stacks.txt"
    path.write_text(raw)
    out = _module().summarise(str(path), top=5, focus=("Engine.step", "VerifierServicer._events", "f"))
    lines = out.splitlines()
    assert lines[0].split() == ["==", "15", "samples", "-m", "tandem", "-v", "serve", "verifier"]
    assert any(line.split()[:2] == ["==", "4"] and line.endswith("process 10") for line in lines)
    engine = next(i for i, line in enumerate(lines) if "replica-engine" in line)
    assert lines[engine].split()[1] == "10" and "66.7% of the process" in lines[engine]
    assert "focus        7  70.0%  Engine.step" in lines[engine + 1]
    assert "focus        3  30.0%  VerifierServicer._events" in lines[engine + 2]
    main = next(i for i, line in enumerate(lines) if "(20): MainThread" in line)
    assert "focus        5 100.0%  f" in lines[main + 1]  # recursion counted once per stack
