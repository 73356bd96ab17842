"""Where the serving processes' interpreters go: a summary of py-spy's sampled stacks.

Record a run and all the processes it starts (the distributed bench: client, router, verifier
replica), then summarise:

    py-spy record --subprocesses --threads --gil --nonblocking --format raw --rate 200 \
        -o stacks.txt -- python3 -m tandem bench ... --mode distributed
    python3 scripts/stack_summary.py stacks.txt [--top 25] [--focus NAME ...]
    python3 scripts/stack_summary.py stacks.txt --under Engine.step   # inside one function: self time too

With ``--gil`` py-spy samples only the thread that holds the interpreter lock, so per process the
samples split the interpreter's time between its threads (in a verifier replica: the engine
thread against the gRPC event loop). For each process and thread the summary prints its samples
and the functions with the most inclusive samples; ``--focus`` names functions (``Class.method``,
or ``name (file.py)``) whose inclusive share is printed for every thread where they ran.
"""

from __future__ import annotations

import argparse
import collections
import re

# what the serving path runs through; their inclusive samples are printed for every thread
DEFAULT_FOCUS = ("ReplicaEngine._run", "Engine.step", "VerifierServicer._events", "VerifierServicer.Generate",
                 "VerifierServicer.Load", "ReplicaLink._read", "Router._run_on", "RouterServicer.Generate",
                 "Metrics.observe_round", "_one (client.py)", "_find_and_load")


def _process_name(frame: str) -> str:
    """``process PID:"COMMAND"`` as a short label (py-spy leaves the command of a process whose
    command line it could not read empty: then the pid)."""
    m = re.match(r'process (\d+):"(.*)"', frame)
    if m is None:
        return frame[:80]
    words = m.group(2).split()
    return " ".join(words[1:6]) if words else f"process {m.group(1)}"


def summarise(path: str, top: int, focus: tuple[str, ...]) -> str:
    threads: collections.Counter = collections.Counter()
    inclusive: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path, errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            i = 0
            while i < len(frames) and frames[i].startswith("process "):
                i += 1
            if i == 0 and not frames[0].startswith("thread "):
                continue
            key = (_process_name(frames[i - 1]) if i else "the recorded process",
                   frames[i] if i < len(frames) and frames[i].startswith("thread ") else "-")
            i += key[1] != "-"
            threads[key] += n
            seen = set()
            for frame in frames[i:]:
                name = re.sub(r" \((.*?):\d+\)", lambda mm: " (" + mm.group(1).split("/")[-1] + ")", frame)
                if name not in seen:
                    seen.add(name)
                    inclusive[key][name] += n
    out = []
    by_process = collections.Counter()
    for (proc, _), n in threads.items():
        by_process[proc] += n
    for proc, total in by_process.most_common():
        out.append(f"== {total:8d} samples  {proc}")
        for (p, thread), n in threads.most_common():
            if p != proc:
                continue
            out.append(f"   -- {n:8d} ({100 * n / total:5.1f}% of the process)  {thread[:70]}")
            counts = inclusive[(p, thread)]
            for name in focus:
                hit = sum(c for fn, c in counts.items() if name in (fn, fn.split(" (")[0]))
                if hit:
                    out.append(f"        focus {hit:8d} {100 * hit / n:5.1f}%  {name}")
            for name, c in counts.most_common(top):
                out.append(f"              {c:8d} {100 * c / n:5.1f}%  {name[:110]}")
    return "\n".join(out)


def under(path: str, name: str, top: int) -> str:
    """Where the samples inside ``name`` (``Class.method``; its innermost call where it recurses)
    go: the share of each function below it, inclusive and as the innermost frame (self time; a
    call into native code counts as its Python caller's)."""
    total = 0
    inclusive: collections.Counter = collections.Counter()
    leaf: collections.Counter = collections.Counter()
    with open(path, errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = [re.sub(r" \((.*?):\d+\)", lambda mm: " (" + mm.group(1).split("/")[-1] + ")", fr)
                      for fr in stack.split(";")]
            at = [j for j, fr in enumerate(frames) if fr.split(" (")[0] == name]
            if not at:
                continue
            n = int(count)
            total += n
            below = frames[at[-1] + 1:]
            for fr in set(below):
                inclusive[fr] += n
            leaf[below[-1] if below else name] += n
    if not total:
        return f"no samples inside {name}"
    out = [f"== {total} samples inside {name}", "-- inclusive"]
    out += [f"   {c:8d} {100 * c / total:5.1f}%  {fn[:110]}" for fn, c in inclusive.most_common(top)]
    out.append("-- self (innermost Python frame)")
    out += [f"   {c:8d} {100 * c / total:5.1f}%  {fn[:110]}" for fn, c in leaf.most_common(top)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stacks", help="py-spy record --format raw output")
    ap.add_argument("--top", type=int, default=25, help="functions listed per thread")
    ap.add_argument("--focus", nargs="*", default=list(DEFAULT_FOCUS), help="functions shown for every thread")
    ap.add_argument("--under", help="instead, where the samples inside this function go (inclusive and self)")
    args = ap.parse_args()
    print(under(args.stacks, args.under, args.top) if args.under else summarise(args.stacks, args.top, tuple(args.focus)))


if __name__ == "__main__":
    main()
