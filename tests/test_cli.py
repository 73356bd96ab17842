"""CLI boundary: user errors are one line on stderr with exit status 2, never a traceback."""

import json
import os
import re

import pytest
from click.testing import CliRunner

from tandem.cli import main
from tandem.cli.common import _unescape


@pytest.fixture()
def run():
    def invoke(*args):
        return CliRunner().invoke(main, list(args))
    return invoke


@pytest.mark.parametrize("args,message", [
    (["generate", "--prompt", "   "], "prompt is empty"),
    (["generate", "--prompt", "hi", "--device", "bogus"], "unknown device 'bogus'"),
    (["generate", "--prompt", "hi", "--model", "/nonexistent"], "does not exist"),
    (["bench", "--model", "/nonexistent", "--no-hf-baseline"], "does not exist"),
    (["bench", "--batch-sizes", "abc"], "--batch-sizes must be positive integers"),
    (["generate", "--prompts-file", "/nonexistent/[bold]x[/bold].jsonl"], "[bold]x[/bold]"),
    (["generate", "--prompt", "hi", "--drafter", "draft-model", "--draft-model", "/nonexistent"], "does not exist"),
    (["generate", "--prompt", "hi", "--drafter", "specformer", "--draft-model", "README.md"], "cannot read SpecFormer head"),
    (["generate"], "give exactly one of --prompt or --prompts-file"),
    (["generate", "--prompt", "hi", "--specformer", "/nonexistent"], "no SpecFormer head at"),
    # a missing head is found before the target (here a missing one too) would load
    (["generate", "--prompt", "hi", "--model", "/nonexistent", "--specformer", "/nonexistent"], "no SpecFormer head"),
    (["generate", "--prompt", "hi", "--specformer", "x", "--drafter", "ngram"], "--specformer needs --drafter specformer"),
    (["generate", "--prompt", "hi", "--specformer", "x", "--draft-model", "y"], "give the SpecFormer head once"),
    (["generate", "--prompt", "hi", "--specformer", " "], "--specformer is empty"),
    (["generate", "--prompt", "hi", "--logit-bias", "x=1"], "--logit-bias takes ID=BIAS"),
    (["generate", "--prompt", "hi", "--logit-bias", "5=500"], "logit_bias values must be numbers in [-100, 100]"),
    (["generate", "--prompt", "hi", "--presence-penalty", "5"], "presence_penalty must be a number in [-2, 2]"),
    (["generate", "--prompt", "hi", "--max-tokens", "8", "--min-tokens", "9"], "min_tokens must be"),
    (["generate", "--prompt", "hi", "--json", "--regex", "a"], "give at most one of --json"),
    # an option that would do nothing is refused, not ignored
    (["generate", "--prompt", "hi", "--limit", "3"], "--limit takes the first N prompts of --prompts-file"),
    (["generate", "--prompt", "hi", "--num-draft-tokens", "8"], "--num-draft-tokens needs a --drafter"),
    (["generate", "--prompt", "hi", "--output", "x.jsonl"], "--output writes a prompts file's completions"),
    (["bench", "--device", "cpu", "--cuda-graphs", "--no-hf-baseline"], "--cuda-graphs needs a CUDA device"),
    (["bench", "--device", "cpu", "--prefill-graphs", "--no-hf-baseline"], "--prefill-graphs needs a CUDA device"),
    (["bench", "--device", "cpu", "--cuda-graphs", "--compile", "--no-hf-baseline"],
     "--cuda-graphs and --compile need a CUDA device"),
    # refused before any process starts: what the HTTP API would refuse, and addresses that are not HOST:PORT
    (["demo", "--temperature", "nan"], "must be a finite number, got nan"),
    (["demo", "--temperature", "5"], "5.0 is not in the range 0<=x<=2"),
    (["demo", "--max-tokens", "300", "--max-seq-len", "256"], "leaves no room for a prompt in the context limit"),
    (["serve", "router", "--port", "18000", "--verifier", "notanaddress"], "expected HOST:PORT"),
    (["serve", "router", "--port", "18000", "--verifier", "127.0.0.1:1", "--verifier", "h:0"], "got 'h:0'"),
    (["serve", "verifier", "--port", "50000", "--drafter-address", "drafter"], "expected HOST:PORT"),
    (["serve", "router", "--port", "18000", "--verifier", "h:1", "--failover-wait", "inf"], "must be a finite number"),
    (["train", "specformer", "--out", "x", "--lr", "nan"], "must be a finite number"),
    (["generate", "--prompt", "hi", "--temperature", "1e30"], "is not in the range 0<=x<=2"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "must be a finite number, got nan"),
    (["generate", "--prompt", "hi", "--top-p", "nan"], "must be a finite number, got nan"),
    (["generate", "--prompt", "hi", "--batch-size", "3"], "with --prompt there is one"),
    (["generate", "--prompt", "hi", "--regex", ""], "--regex: the regular expression is empty"),
    (["bench", "--batch-sizes", "1,64,1"], "names a batch size twice"),
    (["demo", "--model", "/nonexistent"], "--model '/nonexistent' does not exist"),
    (["serve", "router", "--port", "18000", "--verifier", "h:1", "--api-key", ""], "must be a non-empty token"),
    (["serve", "router", "--port", "18000", "--verifier", "h:1", "--api-key", " k"], "without surrounding whitespace"),
    (["serve", "verifier", "--port", "50000", "--policy", "batch-width"], "add --measure-cost"),
    (["serve", "router", "--port", "18000", "--verifier", "http://127.0.0.1:50051"], "expected HOST:PORT"),
    (["bench", "--out", ""], "--out is empty"),
    (["bench", "--admission-share", "1.5"], "1.5 is not in the range 0.0<=x<=1.0"),
    (["bench", "--admission-share", "nan"], "must be a finite number, got nan"),
    (["serve", "verifier", "--port", "50000", "--admission-wait-rounds", "-1"], "-1 is not in the range x>=0"),
    (["generate", "--prompt", "hi", "--policy", "fixed"], "--policy needs a --drafter"),
    (["generate", "--prompt", "hi", "--drafter", "ngram", "--predictor", ""], "--predictor is empty"),
])
def test_user_errors_are_one_line(run, args, message):
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert message in res.stderr
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception


def test_a_bad_seed_is_refused_without_the_greedy_note(run, tiny_checkpoint):
    """An invalid setting is the one error; the note that a valid one does nothing under greedy
    decoding comes only once every setting is valid."""
    res = run("generate", "--prompt", "hi", "--seed", "-1")
    assert res.exit_code == 2 and "seed" in res.stderr
    assert "nothing under greedy" not in res.stderr
    model = str(tiny_checkpoint("llama", with_tokenizer=True))
    res = run("generate", "--model", model, "--prompt", "hi", "--no-chat", "--max-tokens", "2", "--seed", "3")
    assert res.exit_code == 0, res.output
    assert "--seed does nothing under greedy decoding" in " ".join(res.stderr.split())


def test_prompts_file_errors_name_the_line(run, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": "  "}) + "\n")
    res = run("generate", "--prompts-file", str(f))
    assert res.exit_code == 2 and f"{f}:2: the prompt is empty" in res.stderr
    f.write_text("\n\n")
    res = run("generate", "--prompts-file", str(f))
    assert res.exit_code == 2 and "no prompts" in res.stderr


def test_prompts_files_set_prompts_only(run, tmp_path):
    """A row carrying a request field, or a key twice, is refused (never silently dropped); a
    byte-order mark is skipped."""
    from tandem.data import load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hi", "max_tokens": 9, "temperature": 5}) + "\n")
    res = run("generate", "--prompts-file", str(f))
    assert res.exit_code == 2 and f"{f}:1: 'max_tokens', 'temperature': a prompts file holds prompts only" in res.stderr
    f.write_text(json.dumps({"prompt": "hi", "Temperature": 2, "max_new_tokens": 5, "system": "x"}) + "\n")
    res = run("generate", "--prompts-file", str(f))
    assert res.exit_code == 2 and "'Temperature', 'max_new_tokens', 'system'" in res.stderr
    f.write_text('{"prompt": "a", "prompt": "b"}\n')
    res = run("generate", "--prompts-file", str(f))
    assert res.exit_code == 2 and f"{f}:1: the key 'prompt' appears twice" in res.stderr
    # a request field spelt wrong is refused with the right name; both prompt and turns are ambiguous
    f.write_text(json.dumps({"prompt": "hi", "temprature": 0.7, "Max_Token": 3}) + "\n")
    res = run("generate", "--prompts-file", str(f))
    assert res.exit_code == 2 and "'temprature' (did you mean 'temperature'?)" in res.stderr
    assert "'Max_Token' (did you mean 'max_tokens'?)" in res.stderr
    f.write_text(json.dumps({"prompt": "apple", "turns": ["banana"]}) + "\n")
    res = run("generate", "--prompts-file", str(f))
    assert res.exit_code == 2 and f"{f}:1: both 'prompt' and 'turns': give one" in res.stderr
    # metadata keys stay free (Spec-Bench rows carry references, ids, categories)
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "hi", "category": "qa", "reference": "x", "id": 3,
                                                "source": "s", "topic": "t"}).encode() + b"\n")
    [record] = load_prompts(f)
    assert (record.text, record.category) == ("hi", "qa")


def test_bench_makes_its_out_directory_before_running(run, tmp_path):
    """A --out that cannot be written fails before any configuration runs (not after the run)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = run("bench", "--out", str(blocker / "sub"), "--limit", "1", "--no-hf-baseline")
    assert res.exit_code == 2 and f"cannot write --out {blocker / 'sub'}" in res.stderr
    assert "tok/s" not in res.output
    res = run("bench", "--out", str(tmp_path / "a" / "b"), "--batch-sizes", "x")
    assert res.exit_code == 2 and (tmp_path / "a" / "b").is_dir()


def test_structure_files_that_cannot_be_used_are_one_line(run, tmp_path):
    """--json-schema / --grammar files: not UTF-8, or empty, is a one-line error naming the flag."""
    bad, empty = tmp_path / "bad.lark", tmp_path / "empty.json"
    bad.write_bytes(b'start: "a"\xff\n')
    empty.write_text("  \n")
    for flag, path, message in (("--grammar", bad, "is not valid UTF-8"), ("--json-schema", bad, "is not valid UTF-8"),
                                ("--json-schema", empty, "is empty: it should hold a JSON schema"),
                                ("--grammar", empty, "is empty: it should hold a Lark grammar")):
        res = run("generate", "--prompt", "hi", flag, str(path))
        assert res.exit_code == 2 and f"{flag} {path} {message}" in res.stderr, res.output
        assert "Traceback" not in res.output


def test_device_cuda_without_cuda_is_a_clear_error(run):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    res = run("generate", "--prompt", "hi", "--device", "cuda")
    assert res.exit_code == 2 and "is not available here" in res.stderr


def test_unescape_stop_strings():
    assert _unescape(r"a\nb") == "a\nb"
    assert _unescape(r"\t\r\\n") == "\t\r\\n"
    assert _unescape("plain ü") == "plain ü"
    assert _unescape("trailing\\") == "trailing\\"


@pytest.mark.parametrize("args,message", [
    (["generate", "--prompt", "hi", "--acceptance-threshold", "2"], "'--acceptance-threshold': must be a number in [0, 1] or auto"),
    (["generate", "--prompt", "hi", "--acceptance-threshold", "nan"], "'--acceptance-threshold': must be a number in [0, 1] or auto"),
    # checked as the command line is read: before the model (here a missing one) would load
    (["generate", "--prompt", "hi", "--model", "/nonexistent", "--acceptance-threshold", "foo"], "got 'foo'"),
    (["generate", "--prompt", "hi", "--acceptance-threshold", "0.5"], "--acceptance-threshold needs a threshold policy"),
    (["generate", "--prompt", "hi", "--draft-model", "truncate:2"], "--draft-model needs --drafter draft-model"),
    (["generate", "--prompt", "hi", "--drafter", "ngram", "--predictor", "README.md"], "cannot load predictor"),
])
def test_context_aware_option_errors(run, args, message):
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert message in res.stderr


@pytest.mark.parametrize("args,message", [
    (["--tau", "2"], "'--acceptance-threshold': must be a number in [0, 1] or auto"),
    (["--tau", "0.5"], "--acceptance-threshold needs a threshold policy"),  # the value reached the threshold
    (["--tau", "0.5", "--acceptance-threshold", "0.5"], "give --acceptance-threshold only"),
])
def test_tau_is_a_deprecated_alias_of_acceptance_threshold(run, args, message):
    """``--tau`` (τ is the mean accepted length) still sets the acceptance threshold, with a
    deprecation warning; it is hidden from --help."""
    res = run("generate", "--prompt", "hi", *args)
    assert res.exit_code == 2, res.output
    assert "--tau is deprecated" in res.stderr and message in res.stderr
    assert "--tau" not in run("generate", "--help").output


@pytest.mark.parametrize("exc,message", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                  "you tried to allocate 25593643008 bytes."), "can't allocate memory"),
    (MemoryError(), "out of memory: MemoryError"),
])
def test_out_of_memory_is_one_line(run, monkeypatch, exc, message):
    """Running out of memory (CPU allocator, CUDA, Python) is a one-line error, exit 2; any other
    RuntimeError stays a traceback (a bug, not a user error)."""
    import tandem.cli.generate as cli

    def boom(*a, **kw):
        raise exc

    monkeypatch.setattr(cli, "_engine", boom)
    res = run("generate", "--prompt", "hi")
    assert res.exit_code == 2 and message in res.stderr and "out of memory" in res.stderr
    assert "lower the batch size" in res.stderr and isinstance(res.exception, SystemExit)
    monkeypatch.setattr(cli, "_engine", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("a bug")))
    res = run("generate", "--prompt", "hi")
    assert res.exit_code == 1 and isinstance(res.exception, RuntimeError)


@pytest.mark.slow
def test_generate_with_structured_output_and_adjustments(run, tmp_path):
    """The sampling and structured-output options reach the request: a regex holds the output to
    digits; a broken JSON schema is a one-line error naming its option."""
    res = run("generate", "--prompt", "What is 6 times 7?", "--regex", "[0-9]{1,3}", "--max-tokens", "8",
              "--frequency-penalty", "0.5", "--logit-bias", "28=1.5", "--drafter", "ngram")
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().isdigit()
    schema = tmp_path / "s.json"
    schema.write_text("{broken")
    res = run("generate", "--prompt", "hi", "--json-schema", str(schema), "--max-tokens", "8")
    assert res.exit_code == 2 and "the JSON schema is not valid JSON" in res.stderr


def test_generate_says_when_the_context_limit_cut_the_output(run, tiny_checkpoint, tmp_path):
    """An output cut by the context limit before --max-tokens says so on stderr (stdout keeps the
    text only); one that reaches --max-tokens does not."""
    model = str(tiny_checkpoint("llama", with_tokenizer=True))
    res = run("generate", "--model", model, "--prompt", "hi", "--no-chat", "--max-tokens", "500",
              "--max-seq-len", "24", "--min-tokens", "500")  # EOS held off: only the context stops it
    assert res.exit_code == 0, res.output
    assert "stopped at the context limit (--max-seq-len 24)" in " ".join(res.stderr.split())
    res = run("generate", "--model", model, "--prompt", "hi", "--no-chat", "--max-tokens", "3", "--max-seq-len", "24",
              "--min-tokens", "3")
    assert res.exit_code == 0 and "context limit" not in res.stderr
    prompts = tmp_path / "p.jsonl"  # a prompts file's run counts the prompts the limit cut
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "hello"}\n')
    res = run("generate", "--model", model, "--prompts-file", str(prompts), "--no-chat", "--max-tokens", "500",
              "--max-seq-len", "24", "--min-tokens", "500")
    assert res.exit_code == 0, res.output
    assert "2 of 2 prompts stopped at the context limit (--max-seq-len 24)" in " ".join(res.stderr.split())
    # a --max-tokens past the context is said before it binds, whether or not it does (the HTTP API refuses it)
    res = run("generate", "--model", model, "--prompt", "hi", "--no-chat", "--max-tokens", "100000",
              "--max-seq-len", "24", "--min-tokens", "3")
    assert res.exit_code == 0, res.output
    assert "note: --max-tokens 100000 is past the context (--max-seq-len 24" in " ".join(res.stderr.split())
    res = run("generate", "--model", model, "--prompts-file", str(prompts), "--no-chat", "--max-tokens", "20",
              "--max-seq-len", "24")
    assert res.exit_code == 0 and "past the context" not in res.stderr, res.output


def test_generate_takes_a_draft_policy(run, tiny_checkpoint, tmp_path):
    """``--policy batch-width`` reaches the engine (named in the table's title, lossless against
    target-only under --compare); a policy that needs what is not given is a one-line error."""
    model = str(tiny_checkpoint("llama", with_tokenizer=True))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("one two one two", "abc abc abc")))
    res = run("generate", "--model", model, "--prompts-file", str(prompts), "--max-tokens", "12", "--no-chat",
              "--drafter", "ngram", "--policy", "batch-width", "--compare")
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.split())
    assert "drafter ngram, k=4 (batch-width lengths)" in out and re.search(r"\(batch-width lengths\) .*│ 2/2 │", out), out
    # what the policy chose, as make run prints it
    assert re.search(r"draft lengths chosen \(policy batch-width\), share of \d+ verification steps: 0: ", out), out
    for args, message in ((["--policy", "predictor"], "--policy predictor needs --predictor PATH"),
                          (["--policy", "batch-width", "--acceptance-threshold", "0.5"], "policy batch-width sets no"),
                          (["--policy", "fixed", "--predictor", "auto"], "--predictor needs --policy predictor")):
        res = run("generate", "--model", model, "--prompt", "hi", "--drafter", "ngram", *args)
        assert res.exit_code == 2 and message in res.stderr, res.output


def test_generate_writes_a_prompts_files_completions(run, tiny_checkpoint, tmp_path):
    """``--output`` with a prompts file: one JSONL row per prompt, in order, with its text and
    token ids; a path it cannot write (a missing directory, a directory, the prompts file itself) is
    a one-line error before any generation, and a failed run leaves an existing file as it was."""
    model = str(tiny_checkpoint("llama", with_tokenizer=True))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("first one", "second one", "third")))
    out = tmp_path / "out.jsonl"
    res = run("generate", "--model", model, "--prompts-file", str(prompts), "--max-tokens", "5", "--output", str(out))
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as any file the user makes, not a temporary file's 0600
    assert len(rows) == 3 and all(r["completion_tokens"] == len(r["token_ids"]) > 0 for r in rows)
    assert all(isinstance(r["text"], str) and r["finish_reason"] in ("stop", "length") for r in rows)
    for bad, message in ((tmp_path / "no" / "x.jsonl", "cannot write --output"), (tmp_path, "is a directory"),
                         (prompts, "--output would overwrite --prompts-file")):
        res = run("generate", "--model", model, "--prompts-file", str(prompts), "--output", str(bad))
        assert res.exit_code == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.output
    # a run that fails (a prompt over the context limit) leaves the existing file as it was
    before = out.read_text()
    prompts.write_text(json.dumps({"prompt": "word " * 200}) + "\n")
    res = run("generate", "--model", model, "--prompts-file", str(prompts), "--max-seq-len", "64", "--output", str(out))
    assert res.exit_code == 2 and "context limit" in res.stderr
    assert "generating" not in res.stderr  # no progress bar left beside the error on a stderr that is no terminal
    assert out.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "p.jsonl"]


def test_demo_refuses_a_prompts_file_without_prompts(run, tmp_path):
    """An empty prompts file is a one-line error before any process starts, not a traceback after."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    res = run("demo", "--prompts-file", str(empty))
    assert res.exit_code == 2 and f"the prompts file {empty} has no prompts" in res.output, res.output
    assert "stack up" not in res.output


def test_demo_names_the_speculation_and_the_draft_lengths_it_chose(run, tiny_checkpoint, tmp_path):
    """``tandem demo`` (``make run``) through real processes (a drafter service with a one-layer
    draft model: it drafts every step): it names the drafter and the draft policy, and prints the draft lengths chosen per verification step (shares that add up) beside
    the acceptance per draft position, from the requests' ``usage.speculative_decoding``."""

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"question_id": i, "category": "qa", "turns": [t]} for i, t in
            enumerate(["1 2 3 1 2 3 1 2 3 1 2 3", "the cat sat on the mat, the cat sat on the mat", "a b a b a b a b",
                       "word " * 400])]  # the last is past the context limit: refused, the others run
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run("demo", "--model", str(tiny_checkpoint("llama", with_tokenizer=True)), "--prompts-file", str(prompts),
              "--limit", "4", "--max-tokens", "16", "--max-seq-len", "256", "--drafter", "draft-model",
              "--draft-model", "truncate:1", "--num-draft-tokens", "4")
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert re.search(r"refused by the router: \S+: .*context limit", out), out
    assert re.search(r"total\W+3 prompts", out), out
    assert "drafter draft model (truncate:1), k = 4, draft policy fixed" in out
    m = re.search(r"draft lengths chosen \(policy fixed\), share of (\d+) verification steps: (.*?); mean", out)
    assert m and int(m.group(1)) > 0, out
    shares = [int(x) for x in re.findall(r"\d+: (\d+)%", m.group(2))]
    assert len(shares) == 5 and shares[4] > 0, out  # lengths 0 .. k; the draft model drafts k where there is room
    assert abs(sum(shares) - 100) <= len(shares)  # percentages of every step, rounded
    assert re.search(r"acceptance by draft position \(accepted / drafted there\): 1: \d\.\d\d", out), out


def test_info_names_the_model_the_device_and_the_kernels_a_round_runs(run, tiny_checkpoint):
    """``tandem info`` on a CPU: the model's shape, the device, the decode kernels and attention
    the runner resolved, the round's kernels (plain PyTorch ops off CUDA) and the KV cache."""
    res = run("info", "--model", str(tiny_checkpoint("llama", with_tokenizer=True)), "--device", "cpu",
              "--batch-size", "2", "--max-seq-len", "64")
    assert res.exit_code == 0, res.output
    for needle in ("architecture", "llama", "device / dtype", "cpu / float32", "decode kernels / attention",
                   "reference / sdpa-masked", "round kernels", "plain PyTorch ops", "2 slots x 64 tokens"):
        assert needle in res.stdout, (needle, res.stdout)


def test_a_prompt_that_is_not_utf8_names_the_byte():
    """An undecodable byte on a command line (Python's surrogateescape) and a lone surrogate from
    JSON are named as what they are, with their position."""
    from tandem.errors import InvalidRequestError, check_utf8

    with pytest.raises(InvalidRequestError, match=r"prompt is not valid UTF-8 text \(byte 0xff at character 2\)"):
        check_utf8("hi" + b"\xff".decode("utf-8", "surrogateescape"))
    with pytest.raises(InvalidRequestError, match=r"a lone surrogate U\+D800 at character 0"):
        check_utf8("\ud800", "the stop string", "stop")
    check_utf8("héllo, 世界")


@pytest.mark.parametrize("raised,status", [(BrokenPipeError, 141), (KeyboardInterrupt, 130)],
                         ids=["broken-pipe", "ctrl-c"])
def test_a_closed_pipe_and_ctrl_c_end_quietly(raised, status):
    """A reader that leaves (``tandem generate ... | head``) and Ctrl-C end a command without an
    error line, with the status a shell gives them (141: SIGPIPE, 130: SIGINT)."""
    import click

    from tandem.cli import _Group

    @click.group(cls=_Group)
    def group():
        pass

    @group.command()
    def work():
        raise raised()

    res = CliRunner().invoke(group, ["work"])
    assert res.exit_code == status
    assert res.output == "" and "error" not in res.stderr and "Aborted" not in res.stderr
