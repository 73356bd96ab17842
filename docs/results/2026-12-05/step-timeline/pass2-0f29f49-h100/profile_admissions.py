"""The wrapper behind 01.log: `python3 profile_admissions.py bench <tandem bench options>` runs
`tandem bench` with each engine's timed pass (its second `generate`) under torch.profiler, and
prints, per phase (prefill launch, SpecFormer prompt observe, draft priming, chained step), the
host time of the calls inside it. Nested calls of one phase (a subclass calling its parent, an
observe split into groups) are each counted, so a phase's total counts them more than once."""
import collections, sys, torch
from torch.profiler import profile, ProfilerActivity, record_function
import tandem.target as T, tandem.drafters.specformer as S, tandem.bench.spec_bench as B
from tandem.engine import Engine

def wrap(cls, name, label):
    f = getattr(cls, name)
    def g(*a, **k):
        with record_function(label):
            return f(*a, **k)
    setattr(cls, name, g)
wrap(T.LocalTarget, 'launch_prefill', 'PH_prefill')
wrap(S.SpecFormerDrafter, 'observe', 'PH_observe')
wrap(T.LocalTarget, 'prime_drafts', 'PH_prime')
wrap(Engine, '_step_chained', 'PH_round')
calls = collections.Counter()
orig = Engine.generate
def gen(self, *a, **k):
    calls[id(self)] += 1
    if calls[id(self)] != 2:
        return orig(self, *a, **k)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = orig(self, *a, **k)
    torch.cuda.is_available() and torch.cuda.synchronize()
    evs = prof.events()
    for label in ('PH_prefill', 'PH_observe', 'PH_prime', 'PH_round'):
        tops = [e for e in evs if e.name == label]
        agg = collections.Counter(); cnt = collections.Counter()
        def walk(e):
            for c in e.cpu_children:
                agg[c.name] += c.self_cpu_time_total; cnt[c.name] += 1
                walk(c)
        for e in tops: walk(e)
        tot = sum(e.cpu_time_total for e in tops)
        print(f"## {label}: {len(tops)} calls, {tot/1e3:.1f} ms host in all, {tot/1e3/max(1,len(tops)):.2f} ms each")
        for name, us in agg.most_common(14):
            print(f"   {us/1e3:8.2f} ms {cnt[name]:6d}x  {name}")
    sys.stdout.flush()
    return out
Engine.generate = gen
from tandem.cli import main
sys.argv = ['tandem'] + sys.argv[1:]
main()
